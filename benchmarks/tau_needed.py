"""What acceptance each tree needs on this machine, from a bench of random-weight heads.

A drafter's weights do not change what a decoding step costs: a dynamic tree of N nodes drafts the
same levels and verifies the same N tokens whatever the heads predict. Random heads accept nothing
(τ = 1), so a bench of them times every tree's step as it would cost with trained heads, and

    speedup(tree) = τ(tree) × (HF generate's time per token) / (the tree's step time)

tells which τ a tree needs for a target speedup, and what τ measured elsewhere (``--tau``) would give
here. Make the heads and bench them (SmolLM2, the EAGLE-3 recipes' shape):

    python -c "from headway.target import load_target, resolve_target_path; from headway.heads import Eagle3Drafter; \
t, _ = load_target(str(resolve_target_path('smollm2'))); \
Eagle3Drafter.for_target(t, draft_vocab_size=8192, aux_layers=[2, 15, 27]).save_pretrained('runs/random-eagle3')"
    headway bench --target smollm2 --heads runs/random-eagle3 --tree chain-1 dynamic-8-6-24 dynamic-8-6-48 \
        --prompts chat:heldout --num_prompts 4 --max_new_tokens 64 --baselines hf-weight-major --json random.json
    python benchmarks/tau_needed.py random.json --goal 1.3 --tau dynamic-8-6-24=2.38 dynamic-8-6-48=2.53

``--check trained.json`` (a bench of trained heads on the same trees and prompts) sets the speedup each
tree measured beside the one projected for its τ: how far the projection can be trusted.
"""

from __future__ import annotations

import argparse
import json
import sys


def rows(report: dict, goal: float, taus: dict[str, float]) -> list[list[str]]:
    methods = [m for m in report["methods"] if m.get("temperature", 0) == 0]
    hf = next(m for m in methods if m["name"] == "hf-generate")
    hf_ms = 1000 / hf["tokens_per_s"]
    out = [["method", "step ms", "target / drafter / other", "tau for 1.0x", f"tau for {goal:g}x", "given tau -> x"]]
    for m in methods:
        if m["name"] == "hf-generate":
            continue
        steps = m.get("target_forwards") or m["new_tokens"]
        step_ms = 1000 / m["tokens_per_s"] * m["new_tokens"] / steps  # tokens/s at the bench's own τ
        tau = m.get("tau") or 1.0
        if not m.get("tree"):  # an HF baseline: its own speedup
            out.append([m["name"], f"{step_ms:.1f}", "-", "-", "-", f"{m['tokens_per_s'] / hf['tokens_per_s']:.2f}x"])
            continue
        split = " / ".join(f"{100 * m.get(k, 0):.0f}%" for k in ("time_target_share", "time_drafter_share",
                                                                     "overhead_share"))
        given = taus.get(m["tree"])
        out.append([m["name"], f"{step_ms:.1f}", split, f"{step_ms / hf_ms:.2f}", f"{goal * step_ms / hf_ms:.2f}",
                    f"{given:g} -> {given * hf_ms / step_ms:.2f}x" if given else (f"(bench τ {tau:.2f})")])
    return out


def check(report: dict, trained: dict) -> list[list[str]]:
    """The projection against a bench of trained heads: each tree's τ there, the speedup it measured
    and the one the random-weight step times give for that τ."""
    def hf_ms(r: dict) -> float:
        return 1000 / next(m for m in r["methods"] if m["name"] == "hf-generate")["tokens_per_s"]

    step = {m["tree"]: 1000 / m["tokens_per_s"] * m["new_tokens"] / (m.get("target_forwards") or m["new_tokens"])
            for m in report["methods"] if m.get("tree") and m.get("temperature", 0) == 0}
    out = [["trained heads", "τ", "measured", "projected"]]
    for m in trained["methods"]:
        if m.get("tree") in step and m.get("temperature", 0) == 0:
            out.append([m["name"], f"{m['tau']:.2f}", f"{m['speedup']:.2f}x",
                        f"{m['tau'] * hf_ms(report) / step[m['tree']]:.2f}x"])
    return out


def print_table(table: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", help="headway bench --json output of random-weight heads")
    ap.add_argument("--goal", type=float, default=1.3, help="target speedup over HF generate")
    ap.add_argument("--tau", nargs="*", default=[], help="TREE=TAU measured elsewhere, to project here")
    ap.add_argument("--check", help="a bench --json of trained heads on the same trees: measured against projected")
    args = ap.parse_args(argv)
    report = json.load(open(args.report))
    taus = {k: float(v) for k, v in (t.split("=", 1) for t in args.tau)}
    hf = next(m for m in report["methods"] if m["name"] == "hf-generate")
    print(f"{report['settings'].get('target')}, {report['settings'].get('threads')} thread(s): HF generate "
          f"{1000 / hf['tokens_per_s']:.1f} ms/token")
    print_table(rows(report, args.goal, taus))
    if args.check:
        print()
        print_table(check(report, json.load(open(args.check))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
