"""Does the decoder lose acceptance that the drafter has? Teacher-forced depth-1 top-1 of an EAGLE-1/3
drafter on the target's own greedy answers to a bench's prompts, to set beside the depth-1 acceptance
`headway bench` reports on the same prompts. The prompts are tokenised as bench does
(``data.plans.prompt_ids``); the answer is HF greedy; the drafter reads the target's real features at
every position (its cache holds (x_{t+1}, f_t)), and its output at the entry before each answer
position's token (the tree root) is compared with the token after it (the depth-1 draft).

    python benchmarks/teacher_forced.py HEADS [SOURCE ...] [--num N] [--tokens T] [--threads K]
    # default: chat:heldout, 10 prompts x 64 tokens (the README bench), the cached smollm2 target
"""
import argparse
from pathlib import Path

import torch

from headway.data.chat import load_chat_template
from headway.data.plans import prompt_ids
from headway.data.sources import read_samples
from headway.decode.proposers import hidden_index
from headway.heads.layers import DraftCache, causal_mask
from headway.heads.load import load_heads
from headway.target import load_target

ap = argparse.ArgumentParser()
ap.add_argument("heads")
ap.add_argument("sources", nargs="*", default=["chat:heldout"])
ap.add_argument("--target", default=str(Path.home() / ".cache/headway/targets/smollm2-0.1.2"))
ap.add_argument("--num", type=int, default=10)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)
model, tok = load_target(args.target, device="cpu")
model.eval()
drafter = load_heads(args.heads, target=model).eval()
template = load_chat_template(tok, None)
layers = model.config.num_hidden_layers


@torch.inference_mode()
def top1(ids: list[int]) -> torch.Tensor:
    """1.0 / 0.0 per answer position: the drafter's depth-1 draft there equals the target's token."""
    seq = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False)
    hidden = model(seq, output_hidden_states=True).hidden_states
    n = seq.shape[1] - 1
    feats = [hidden[hidden_index(la, layers)][:, :n] for la in drafter.feature_layers]  # f_t, t < n
    out = drafter(seq[:, 1:], drafter.fuse(feats), torch.arange(n)[None],
                  causal_mask(n, 0, drafter.fc.weight.dtype, seq.device), DraftCache())
    pred = drafter.draft_to_target_ids(drafter.draft_logits(out)[0].argmax(-1))  # pred[t]: the token at t + 2
    t = torch.arange(len(ids) - 1, n - 1)  # roots at len(ids) .. n - 1: entry root - 1 drafts the token after it
    return (pred[t] == seq[0, t + 2]).float()


for source in args.sources:
    per = [top1(prompt_ids(s, tok, template, "auto", "the target")[0])
           for s in read_samples(source, tokenizer=tok, limit=args.num).samples]
    allpos = torch.cat(per)
    print(f"{source}: teacher-forced depth-1 top-1 {allpos.mean():.3f} over {allpos.numel()} positions "
          f"({len(per)} prompts x up to {args.tokens} tokens); per prompt "
          + " ".join(f"{p.mean():.2f}" for p in per), flush=True)
