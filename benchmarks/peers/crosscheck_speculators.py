"""Does ``headway import`` compute what speculators trained? Two halves, one per venv:

    # in speculators' venv: its own Eagle3DraftModel on row 0 of the prepared data, every TTT step's logits
    PEERS/speculators/bin/python benchmarks/peers/crosscheck_speculators.py dump CKPT OUT/speculators/data x.safetensors
    # in headway's venv: the imported drafter on the same inputs, the same unrolled steps
    .venv/bin/python benchmarks/peers/crosscheck_speculators.py compare CKPT TARGET x.safetensors

Both sides read the same row (speculators' ``shift_batch`` alignment: token x_{t+1} with the target's
state at t); the comparison prints the largest logit difference and the argmax agreement per step.
"""
import sys

import torch
from safetensors.torch import load_file, save_file


def dump(ckpt: str, data: str, out: str, steps: int = 3) -> None:
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch

    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(ckpt)
    cfg.transformer_layer_config._attn_implementation = "sdpa"  # flex attention needs a GPU (as in training: sdpa)
    model = Eagle3DraftModel.from_pretrained(ckpt, config=cfg, dtype=torch.float32).eval()
    hs = load_file(f"{data}/hidden_states/hs_0.safetensors")
    T = hs["token_ids"].numel()
    batch = shift_batch({"input_ids": hs["token_ids"], "hidden_states": hs["hidden_states"][:, :3].flatten(1),
                         "verifier_last_hidden_states": hs["hidden_states"][:, 3], "loss_mask": torch.ones(T),
                         "lengths": torch.tensor([T]), "position_ids": torch.arange(T)})
    logits = []
    hook = model.lm_head.register_forward_hook(lambda m, a, o: logits.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=batch["hidden_states"][None], input_ids=batch["input_ids"][None],
              document_ids=torch.zeros(1, T - 1, dtype=torch.long), position_ids=batch["position_ids"][None],
              ttt_steps=steps)
    hook.remove()
    save_file({"token_ids": hs["token_ids"].contiguous(), "aux": hs["hidden_states"][:, :3].contiguous(),
               **{f"logits.{j}": x[0].contiguous() for j, x in enumerate(logits)}}, out)


def compare(ckpt: str, target_dir: str, dumped: str) -> None:
    from headway.heads.importers import import_heads
    from headway.target import load_target
    from headway.train.ttt import unroll

    target, _ = load_target(target_dir, device="cpu")
    d = import_heads(ckpt, target=target).eval()
    x = load_file(dumped)
    ids, aux = x["token_ids"][None].long(), x["aux"][None].float()  # (1, T), (1, T, 3, H)
    T = ids.shape[1]
    steps = sum(k.startswith("logits.") for k in x)
    with torch.no_grad():  # headway pairs x_{t+1} with the state at t itself: the same rows, one longer
        ours = [lg[0] for _, lg in unroll(d, ids, d.fuse([aux[:, :, j] for j in range(3)]), steps)]
    for j in range(steps):
        n = T - 1 - j  # positions whose step-j token is real on both sides
        a, b = ours[j][:n], x[f"logits.{j}"][:n].float()
        agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        print(f"step {j}: max |logit diff| {float((a - b).abs().max()):.4f} (logits up to {float(b.abs().max()):.2f}), "
              f"argmax agreement {agree:.4f} over {n} positions")


if __name__ == "__main__":
    {"dump": dump, "compare": compare}[sys.argv[1]](*sys.argv[2:])
