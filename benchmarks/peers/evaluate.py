"""Measure EAGLE-3 drafters with headway's own evaluation: each checkpoint (a headway heads folder, or a
peer's checkpoint, imported with ``headway.heads.importers.import_heads``) is scored on the same held-out
rows with the sums ``headway train`` reports (``train.eagle.eval_sums`` / ``summarize``): teacher-forced
top-1 by depth, and the simulated chain acceptance (tau, depth 5) against the data and against the
target's greedy choice.

    python benchmarks/peers/evaluate.py --target DIR --data DATASET --rows 400: --out eval.json \\
        headway=runs/demo-eagle3/final speculators=runs/peers/speculators/checkpoints/latest ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def held_out(dataset: str, rows: str) -> list[dict[str, Any]]:
    """Rows ``a:b`` (python slice) of a headway dataset, as {input_ids, loss_mask} dicts."""
    from headway.data.distill import load_distilled

    ds = load_distilled(dataset)
    a, _, b = rows.partition(":")
    idx = range(len(ds))[slice(int(a) if a else None, int(b) if b else None)]
    return ds.select(list(idx)).select_columns(["input_ids", "loss_mask"]).to_list()


def load_drafter(path: str, target: torch.nn.Module) -> Any:
    """A headway heads folder as is; anything else through ``headway import``'s reader."""
    from headway.heads.importers import import_heads
    from headway.heads.load import load_heads

    cfg = Path(path) / "config.json"
    if cfg.is_file() and "headway_version" in json.loads(cfg.read_text()):
        return load_heads(path, target=target).eval()
    return import_heads(path, target=target).eval()


def target_batches(target: torch.nn.Module, rows: list[dict[str, Any]], layers: list[int], batch_size: int = 8,
                   max_length: int = 384) -> list[Any]:
    """The target's side of the evaluation, once per held-out set: each batch's states at ``layers`` and
    the target's argmax (its logits are dropped: 8 rows x 384 x 49k floats would not stay in memory)."""
    from headway.train.batch import collate, target_batch

    out = []
    with torch.no_grad():
        for b in range(0, len(rows), batch_size):
            tb = target_batch(target, collate(rows[b: b + batch_size], pad_id=0, max_length=max_length),
                              sorted(set(layers) | {-1}), True)
            tb.top, tb.logits = tb.logits.argmax(-1), None  # (B, T) target ids
            out.append(tb)
    return out


def evaluate_batches(drafter: Any, batches: list[Any]) -> dict[str, Any]:
    """headway's eval sums over prepared batches, summed as ``headway train`` sums them."""
    from headway.train.eagle import EVAL_DEPTH, eval_sums, summarize

    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for tb in batches:
            hidden = drafter.fuse([tb.hidden[i] for i in drafter.feature_layers])
            stats = eval_sums(drafter, tb, hidden, EVAL_DEPTH)
            for k, v in stats.items():
                totals[k] = totals[k] + v if k in totals else v.clone()
    out = summarize(totals)
    keys = ("tau", "tau_greedy", "tau_decode", "top1", "accept_rate_by_depth", "accept_rate_by_depth_decode",
            "positions", "decode_steps")
    return {k: out[k] for k in keys if k in out}


def evaluate(drafter: Any, target: torch.nn.Module, rows: list[dict[str, Any]], batch_size: int = 8,
             max_length: int = 384) -> dict[str, Any]:
    """headway's eval sums over ``rows`` for one drafter."""
    return evaluate_batches(drafter, target_batches(target, rows, list(drafter.feature_layers), batch_size,
                                                    max_length))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", help="NAME=PATH")
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True, help="a headway distilled dataset")
    ap.add_argument("--rows", default="-48:", help="python slice of held-out rows (default: the last 48)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from headway.target import load_target, resolve_target_path

    target, _ = load_target(resolve_target_path(args.target), device="cpu")  # a built-in name, or a folder
    rows = held_out(args.data, args.rows)
    report = {"target": args.target, "data": args.data, "rows": args.rows, "num_rows": len(rows), "drafters": {}}
    cache: dict[tuple[int, ...], list[Any]] = {}  # the target's states, once per set of layers
    for spec in args.drafters:
        name, _, path = spec.partition("=")
        d = load_drafter(path, target)
        layers = tuple(d.feature_layers)
        if layers not in cache:
            cache[layers] = target_batches(target, rows, list(layers))
        report["drafters"][name] = {"path": path, **evaluate_batches(d, cache[layers])}
        print(name, json.dumps(report["drafters"][name]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
