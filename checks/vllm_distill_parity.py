"""Check `headway distill --engine vllm` against the transformers backend with the real vLLM (CPU build).

    .venv/bin/python checks/vllm_distill_parity.py --vllm-python /path/to/vllm-venv/bin/python
    .venv/bin/python checks/vllm_distill_parity.py --targets tiny demo --num-prompts 32 --max-new-tokens 64

For each target (`tiny`: a random 4-layer Llama with head_dim 32, built in seconds, vLLM's CPU
attention needs head_dim >= 32; `demo`: the cached demo target, ~/.cache/headway/targets/demo-*;
or a folder), `headway distill` writes the same `demo:train` prompts twice at temperature 0 in
float32, once with `--engine hf` and once with `--engine vllm` (one engine start), and the rows
are compared column by column. For each row that differs, the first differing answer token is
checked against the target's own fp32 logits (transformers, unbatched, on the common prefix): the
gap between the logits of the token transformers chose and the one vLLM chose, and the top-1/top-2
gap there. A difference is a "near-tie" when that gap is below --tie (logit units).
Speed: generated tokens per second of each backend's generation (shard seconds, the vLLM engine's
start excluded and reported separately). Results: WORK/results.json. Exit 0 when every differing
row is a near-tie (or none differs), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_WORK = "~/.cache/headway/vllm-distill-check"


def find_target(name: str, work: Path) -> Path:
    if name == "tiny":
        from headway.testing import save_tiny_target

        folder = work / "tiny-hd32"
        if not (folder / "config.json").is_file():
            save_tiny_target(folder, "llama", num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        return folder
    if name == "demo":
        folder = built_demo()
        if folder is None:
            raise SystemExit("no built demo target in the cache (run `headway target build`)")
        return folder
    return Path(name).expanduser()


def built_demo() -> Path | None:
    """The demo preset's own cached build (the cache holds other demo-* folders, e.g. bench's assistant)."""
    from headway.demo.builder import TargetBuildConfig, target_dir

    folder = target_dir(TargetBuildConfig(preset="demo"))
    return folder if (folder / "config.json").is_file() else None


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def tie_report(model, hf_ids: list[int], vl_ids: list[int]) -> dict:
    """Where two rows part: the target's fp32 logits (unbatched) on the common prefix."""
    import torch

    k = first_difference(hf_ids, vl_ids)
    row = {"position": k, "hf_token": hf_ids[k] if k < len(hf_ids) else None,
           "vllm_token": vl_ids[k] if k < len(vl_ids) else None}
    with torch.inference_mode():
        logits = model(torch.tensor([hf_ids[:k]])).logits[0, -1].double()  # (V,)
    top = torch.topk(logits, 2)
    row["top1_top2_gap"] = float(top.values[0] - top.values[1])
    if row["hf_token"] is not None and row["vllm_token"] is not None:
        row["hf_minus_vllm_logit"] = float(logits[row["hf_token"]] - logits[row["vllm_token"]])
        row["hf_rank_of_vllm_token"] = int((logits > logits[row["vllm_token"]]).sum())
    return row


def run(target: Path, engine: str, out: Path, args: argparse.Namespace) -> tuple[list[dict], dict, float]:
    from headway.data.distill import DistillConfig, distill, load_distilled

    cfg = DistillConfig(source="demo:train", target=str(target), output=str(out), limit=args.num_prompts,
                        prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens, temperature=0.0,
                        dtype="float32", batch_size=args.hf_batch_size, shard_size=args.num_prompts,
                        engine=engine, vllm_python=args.vllm_python, overwrite=True)
    t0 = time.perf_counter()
    distill(cfg)
    wall = time.perf_counter() - t0
    manifest = json.loads((out / "headway_distill.json").read_text())
    return load_distilled(out).to_list(), manifest, wall


def check(name: str, args: argparse.Namespace, work: Path) -> dict:
    from headway.target import load_target

    target = find_target(name, work)
    label = target.name  # outputs under WORK, whatever the target's path
    hf, hf_m, hf_wall = run(target, "hf", work / f"{label}-hf", args)
    vl, vl_m, vl_wall = run(target, "vllm", work / f"{label}-vllm", args)
    model, _ = load_target(str(target), "float32", "cpu")
    same = [a == b for a, b in zip(hf, vl)]
    diffs = [dict(index=a["index"], **tie_report(model, a["input_ids"], b["input_ids"]))
             for a, b, s in zip(hf, vl, same) if not s]
    for d in diffs:
        d["near_tie"] = abs(d.get("hf_minus_vllm_logit", float("inf"))) < args.tie
    return {"target": str(target), "rows": len(hf), "rows_vllm": len(vl), "rows_equal": sum(same),
            "answers_equal": sum(a["input_ids"] == b["input_ids"] for a, b in zip(hf, vl)),
            "differences": diffs, "explained": all(d["near_tie"] for d in diffs) and len(hf) == len(vl),
            "hf": {"tokens_per_s": hf_m["tokens_per_s"], "generated_tokens": hf_m["generated_tokens"],
                   "generation_s": round(hf_m["seconds"], 2), "wall_s": round(hf_wall, 1),
                   "batch_size": args.hf_batch_size, "engines": hf_m["engines"]},
            "vllm": {"tokens_per_s": vl_m["tokens_per_s"], "generated_tokens": vl_m["generated_tokens"],
                     "generation_s": round(vl_m["seconds"], 2), "wall_s": round(vl_wall, 1),
                     "engine_start_and_load_s": round(vl_wall - vl_m["seconds"], 1), "engines": vl_m["engines"]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("HEADWAY_VLLM_PYTHON"),
                    help="the vLLM environment's python (default: $HEADWAY_VLLM_PYTHON)")
    ap.add_argument("--targets", nargs="+", default=["tiny", "demo"],
                    help="tiny (random, head_dim 32), demo (cached demo target; skipped when none is built), "
                         "or folders")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=8, help="distill's batch_size for the hf backend")
    ap.add_argument("--tie", type=float, default=1e-3, help="logit gap below which a difference is a near-tie")
    ap.add_argument("--work", default=DEFAULT_WORK)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    names = [t for t in args.targets if t != "demo" or built_demo() is not None]
    if len(names) < len(args.targets):
        print("no built demo target in ~/.cache/headway/targets: skipped (`headway target build` builds it)")
    results = []
    for name in names:
        r = check(name, args, work)
        results.append(r)
        print(json.dumps(r), flush=True)
    (work / "results.json").write_text(json.dumps({"prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                                                   "results": results}, indent=2))
    print(f"\n{'target':<48}{'rows equal':<12}{'near-ties':<11}{'hf tok/s':<10}{'vLLM tok/s':<12}{'vLLM start s'}")
    for r in results:
        ties = sum(d["near_tie"] for d in r["differences"])
        print(f"{Path(r['target']).name:<48}{r['rows_equal']}/{r['rows']:<9}{ties}/{len(r['differences']):<9}"
              f"{r['hf']['tokens_per_s']:<10}{r['vllm']['tokens_per_s']:<12}{r['vllm']['engine_start_and_load_s']}")
    print(f"results: {work / 'results.json'}")
    return 0 if all(r["explained"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
