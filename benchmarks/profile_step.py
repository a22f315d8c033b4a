"""Where a decode step's time goes: target forward, drafter forward, and everything else
(tree building, verification, cache bookkeeping, Python). The goal is "everything else" <= 15%.

    python benchmarks/profile_step.py --target demo --heads runs/demo/eagle3/final [--tree dynamic-4-5-16]
Without --heads, random-weight heads of each kind are used (acceptance is then ~0, which is the
worst case for the overhead share: every step emits one token).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


class ForwardTimer:
    """Accumulates wall time spent inside a module's forward (outermost calls only)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.total, self._depth, self._t = 0.0, 0, 0.0
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_: object) -> None:
        if self._depth == 0:
            self._t = time.perf_counter()
        self._depth += 1

    def _post(self, *_: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.total += time.perf_counter() - self._t


class MethodTimer:
    """Accumulates wall time inside the given methods of a class (the drafter's forwards and the
    logits they produce: EAGLE-1's go through the target's lm_head, outside the heads module)."""

    def __init__(self, cls: type, names: list[str]) -> None:
        self.total = 0.0
        for name in names:
            fn = getattr(cls, name)

            def timed(*a, _fn=fn, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.total += time.perf_counter() - t

            setattr(cls, name, timed)


def profile(spec, prompts, max_new: int) -> dict:
    from headway.decode.proposers import EagleProposer, MedusaProposer

    tt = ForwardTimer(spec.target)
    dt = MethodTimer(EagleProposer if isinstance(spec.new_proposer(), EagleProposer) else MedusaProposer,
                     ["_catch_up", "expand"] if isinstance(spec.new_proposer(), EagleProposer) else ["_set"])
    spec.generate(prompts[0], max_new_tokens=8)  # warm-up
    tt.total = dt.total = 0.0
    steps = total = prefill = tokens = 0.0
    for p in prompts:
        out = spec.generate(p, max_new_tokens=max_new)
        total += out.stats.time_total
        prefill += out.stats.time_prefill
        steps += out.stats.target_forwards
        tokens += out.stats.new_tokens
    step_time = total - prefill
    # prefill's target forward is inside tt.total: take it out with the measured prefill time
    target_in_steps = max(tt.total - prefill, 0.0)
    other = step_time - target_in_steps - dt.total
    return {"steps": steps, "tau": (tokens - len(prompts)) / max(steps, 1), "ms_per_step": 1e3 * step_time / steps,
            "target_share": target_in_steps / step_time, "draft_share": dt.total / step_time,
            "other_share": other / step_time, "tokens_per_s": tokens / total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="demo")
    ap.add_argument("--heads", nargs="*", default=[])
    ap.add_argument("--tree", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from headway.data.sources import read_samples
    from headway.target import resolve_target_path
    from headway.decode import Speculator
    from headway.heads import Eagle1Drafter, Eagle3Drafter, MedusaHeads
    from headway.target import load_target

    model, tok = load_target(resolve_target_path(args.target))
    prompts = [s.prompt for s in read_samples("demo:heldout", tokenizer=tok, prompt_tokens=64,
                                              limit=args.prompts).samples]
    heads = args.heads or [MedusaHeads.for_target(model, num_heads=4), Eagle1Drafter.for_target(model),
                           Eagle3Drafter.for_target(model, draft_vocab_size=2048)]
    report = {}
    for h in heads:
        spec = Speculator.from_pretrained(model, h, tokenizer=tok, tree=args.tree)
        name = f"{type(spec.heads).__name__}/{getattr(spec.tree, 'name', spec.tree)}"
        report[name] = profile(spec, prompts, args.max_new_tokens)
        print(name, json.dumps({k: round(v, 3) for k, v in report[name].items()}), flush=True)


if __name__ == "__main__":
    main()
