"""Does ``headway import`` of a ModelOpt export compute what ModelOpt trained? Two halves, one per venv:

    PEERS/modelopt/bin/python benchmarks/peers/crosscheck_modelopt.py dump OUT x.safetensors [PERTURBED_EXPORT]
    .venv/bin/python benchmarks/peers/crosscheck_modelopt.py compare OUT/modelopt/export TARGET x.safetensors

``dump`` rebuilds the drafter as ModelOpt trains it (``mtsp.convert`` on the target, the exported
weights loaded into ``eagle_module``) and runs one step of its ``EagleModule`` on row 0 (token x_{t+1}
with the target's fused state at t, causal attention); ``compare`` runs the imported drafter on the same
inputs. It prints the largest logit difference and the argmax agreement.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def dump(out: str, dumped: str) -> None:
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import eagle3_default_config
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    plan = json.loads((Path(out) / "plan.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(plan["target"], dtype=torch.float32)
    export = Path(out) / "modelopt" / "export"
    cfg = json.loads((export / "config.json").read_text())
    c = model.config
    arch = {**eagle3_default_config, **{k: cfg[k] for k in ("intermediate_size", "num_attention_heads",
                                                               "num_key_value_heads", "head_dim", "rms_norm_eps",
                                                               "rope_theta", "rope_scaling", "draft_vocab_size")},
            "eagle_aux_hidden_state_layer_ids": cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    mtsp.convert(model, [("eagle", {"eagle_offline": True, "eagle_architecture_config": arch,
                                    "eagle_use_torch_compile": False, "eagle_export_rope_scaling": {}})])
    em = model.eagle_module.eval()
    missing, unexpected = em.load_state_dict(load_file(str(export / "model.safetensors")), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    em._maybe_init_rope()
    if len(sys.argv) > 4:  # a spread input_layernorm (few steps at a low LR leave it near uniform, which
        # hides how ModelOpt uses it): the perturbed weights go to a copy of the export for ``compare``
        torch.manual_seed(0)
        with torch.no_grad():
            em.layers[0].input_layernorm.weight.mul_(1 + 0.3 * torch.randn(em.config.hidden_size))
        copy = Path(sys.argv[4])
        copy.mkdir(parents=True, exist_ok=True)
        (copy / "config.json").write_text((export / "config.json").read_text())
        sd = {k: v.contiguous() for k, v in em.state_dict().items() if "rotary" not in k}
        save_file(sd, str(copy / "model.safetensors"))
    sample = torch.load(sorted((Path(out) / "modelopt" / "data").glob("*.pt"))[0], weights_only=True)
    ids, aux = sample["input_ids"], sample["aux_hidden_states"]  # (T,), (T, 3H)
    T = ids.numel()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids[1:])[None]  # x_{t+1}
        hidden = em.fc(aux[:-1][None])  # fused state at t
        mask = torch.full((T - 1, T - 1), torch.finfo(torch.float32).min).triu(1)[None, None]
        post, pre, _ = em(hidden, embeds, attention_mask=mask, position_ids=torch.arange(T - 1)[None])
        logits = em.lm_head(post)[0]
    save_file({"input_ids": ids.contiguous(), "aux": aux.contiguous(), "logits": logits.contiguous(),
               "input_layernorm_spread": em.layers[0].input_layernorm.weight.std().reshape(1)}, dumped)


def compare(export: str, target_dir: str, dumped: str) -> None:
    from headway.heads.importers import import_heads
    from headway.heads.layers import causal_mask
    from headway.target import load_target

    target, _ = load_target(target_dir, device="cpu")
    d = import_heads(export, target=target).eval()
    x = load_file(dumped)
    ids, aux = x["input_ids"].long(), x["aux"].float()
    T, H = ids.numel(), aux.shape[-1] // 3
    with torch.no_grad():
        hidden = d.fuse([aux[None, :-1, j * H:(j + 1) * H] for j in range(3)])
        out = d(ids[None, 1:], hidden, torch.arange(T - 1)[None], causal_mask(T - 1, 0, torch.float32, "cpu"))
        ours = d.logits(out)[0]
    theirs = x["logits"]
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"max |logit diff| {float((ours - theirs).abs().max()):.4f} (logits up to {float(theirs.abs().max()):.2f}), "
          f"argmax agreement {agree:.4f} over {T - 1} positions; input_layernorm weight std "
          f"{float(x['input_layernorm_spread']):.4f}")


if __name__ == "__main__":
    {"dump": dump, "compare": compare}[sys.argv[1]](*sys.argv[2:4] if sys.argv[1] == "dump" else sys.argv[2:])
