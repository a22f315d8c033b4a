"""What projecting only the read lm_head rows saves per verify step, side by side in one run.

    .venv/bin/python experiments/verify_logits.py --target smollm2 --trees dynamic-4-6-9 dynamic-8-6-48

The drafts come from an oracle that knows the target's greedy continuation (HF generate) and puts
its next token at rank 0 with probability ``--rank0``, at rank 1 with ``--rank1``, else nowhere: the
acceptance of trained heads without training any (the defaults are near the SmolLM2 EAGLE-3 heads'
depth-1 acceptance, 0.73). The drafter then costs nothing, so the table compares the target's time
per step (its forward plus the rows verification projects) and ms per token of the target alone,
with ``verify_logits="auto"`` (on-demand rows) against ``"all"`` (every node), on the same trees
and prompts, modes interleaved per prompt. Every generation is checked against HF greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from headway.bench.configs import BenchConfig
from headway.bench.run import load_prompts
from headway.decode import Speculator
from headway.heads import Eagle3Drafter
from headway.target import load_target, resolve_target_path


class Oracle:
    """A proposer drafting the reference continuation at rank 0 or 1 (or not at all)."""

    def __init__(self, ref: list[int], prompt_len: int, vocab: int, rank0: float, rank1: float, seed: int,
                 feature_layers: list[int]) -> None:
        self.ref, self.n, self.V, self.rank0, self.rank1 = ref, prompt_len, vocab, rank0, rank1
        self.g = torch.Generator().manual_seed(seed)
        self.max_depth, self.feature_layers, self.draft_vocab_size = None, feature_layers, vocab
        self.temperatures: list[float] = []

    def prefill(self, tokens, valid, position_ids, features, first) -> None:  # noqa: ANN001 - the Proposer protocol
        self.root = tokens.shape[1]  # a batch of one prompt

    def accept(self, paths, features, starts) -> None:  # noqa: ANN001
        self.root = starts[0] + paths[0].numel() - 1

    def _dist(self, depth: int) -> torch.Tensor:
        logp = torch.randn(self.V, generator=self.g)
        pos = self.root + depth - self.n
        if 0 <= pos < len(self.ref):
            u, want = float(torch.rand((), generator=self.g)), self.ref[pos]
            if u < self.rank0:
                logp[want] = 30.0
            elif u < self.rank0 + self.rank1:
                logp[want], logp[(want + 1) % self.V] = 20.0, 30.0
        return logp.log_softmax(-1)

    def root_logprobs(self) -> torch.Tensor:
        return self._dist(1)[None]

    def expand(self, parent_rows, tokens, depth) -> torch.Tensor:  # noqa: ANN001
        return self._dist(depth + 1).expand(*tokens.shape, -1)

    def end_tree(self) -> None:
        """Nothing to drop: the oracle keeps no per-tree state (a drafter's KV cache would be cut here)."""

    def select(self, keep) -> None:  # noqa: ANN001
        """One row: nothing to select."""

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--trees", nargs="+", default=["dynamic-4-6-9", "dynamic-4-5-16", "dynamic-6-6-24",
                                                    "dynamic-8-6-32", "dynamic-8-6-48"])
    ap.add_argument("--prompts", default="chat:heldout")
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rank0", type=float, default=0.6)
    ap.add_argument("--rank1", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target(resolve_target_path(args.target), dtype="float32")
    cfg = BenchConfig(target=args.target, prompts=args.prompts, num_prompts=args.num_prompts, progress=False)
    prompts = load_prompts(cfg, tok).ids
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.max_new_tokens,
                             do_sample=False)
        refs.append(out[0, len(ids):].tolist())
    heads = Eagle3Drafter.for_target(model, draft_vocab_size=8192)  # only its feature layers are used
    V = model.get_output_embeddings().weight.shape[0]
    rows = []
    print(f"{args.target}: {len(prompts)} prompts ({args.prompts}) x {args.max_new_tokens} tokens, {args.threads} "
          f"threads, oracle drafts rank 0 {args.rank0}, rank 1 {args.rank1}", file=sys.stderr)
    for tree in args.trees:
        specs = {m: Speculator(model, tok, heads, tree=tree, verify_logits=m) for m in ("auto", "all")}
        per: dict[str, dict[str, list[float]]] = {m: {"step_ms": [], "tok_ms": [], "proj": []} for m in specs}
        taus: dict[str, list[float]] = {m: [] for m in specs}
        for i, (ids, ref) in enumerate(zip(prompts, refs)):
            for m in (("auto", "all") if i % 2 == 0 else ("all", "auto")):
                spec = specs[m]
                spec.new_proposer = lambda ids=ids, ref=ref, i=i: Oracle(ref, len(ids), V, args.rank0, args.rank1,
                                                                         i, heads.feature_layers)
                scored_log: list = []
                score = Speculator.draft_and_score.__get__(spec)
                spec.draft_and_score = lambda *a, score=score, log=scored_log: log.append(s := score(*a)) or s
                out = spec.generate(ids, max_new_tokens=args.max_new_tokens)
                if out.ids != ref[:len(out.ids)]:
                    raise SystemExit(f"{tree} {m}: prompt {i} differs from HF greedy")
                st = out.stats
                per[m]["step_ms"].append(1000 * st.time_verify / st.target_forwards)
                per[m]["tok_ms"].append(1000 * (st.time_verify + st.time_prefill) / st.new_tokens)
                per[m]["proj"] += [s.node_logits.projections for s in scored_log]
                taus[m].append(st.tau)
        row = {"tree": tree, "tau": statistics.mean(taus["auto"])}
        for m in specs:
            row[f"{m}_step_ms"] = statistics.median(per[m]["step_ms"])
            row[f"{m}_ms_per_token"] = statistics.median(per[m]["tok_ms"])
        row["projections_per_step"] = statistics.mean(per["auto"]["proj"])
        row["step_ratio"] = row["auto_step_ms"] / row["all_step_ms"]
        rows.append(row)
        print(f"{tree:16s} tau {row['tau']:.2f}  target ms/step: all {row['all_step_ms']:6.1f}  on-demand "
              f"{row['auto_step_ms']:6.1f}  ({row['step_ratio']:.2f}x, {row['projections_per_step']:.2f} "
              f"projections/step)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
