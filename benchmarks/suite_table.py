#!/usr/bin/env python
"""One markdown table of per-category tau from `headway eval` reports (schema headway.eval/1, the
headway engine), heads trained with several seeds pooled into mean ± spread.

    python benchmarks/suite_table.py benchmarks/results/spec-bench/*-headway.json
    python benchmarks/suite_table.py A.json B.json --group 'e3-1k5-s\\d+=EAGLE-3 1k5' --key accepted
    python benchmarks/suite_table.py benchmarks/results/spec-bench/vllm-*.json --side vllm

Reports of `headway eval --engine vllm` are read too: each heads' per-category tau from vLLM's spec-decode
counters (`--side vllm`, the default for them) or from headway's decoder on the same prompts (`--side headway`),
and its `all` cell from the summed counts (1 + accepted / drafts, prefill left out, as vLLM counts). Only
tau is read from them, and a table pools reports of one engine.

Each row is a group of methods: by default the heads folder with a trailing seed (`-s0`, `-s1`, ...)
stripped, so runs/exp/e3-1k5-s0 and runs/exp/e3-1k5-s2 are one row; `--group REGEX=LABEL` names
groups by a regular expression on the heads path instead. Cells: the mean over the group's seeds,
`± sd` (sample standard deviation) where there are two or more. Baselines (no heads) are left out.
Only reports that asked the same questions are pooled (their suite, sample and max_new_tokens must
match): tau from different samples would not be comparable.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

SEED = re.compile(r"-s\d+$")


def group_name(heads: str, rules: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, label in rules:
        if pattern.search(heads):
            return label
    path = Path(heads.rstrip("/"))
    name = path.parent.name if path.name == "final" else path.name
    return SEED.sub("", name)


def sample_of(report: dict[str, Any]) -> tuple[Any, ...]:
    """What must match for two reports' numbers to be pooled: the suite and the questions asked."""
    suite, settings = report["suite"], report["settings"]
    return (suite["name"], suite["per_category"], suite["seed"], json.dumps(suite["categories"], sort_keys=True),
            settings["max_new_tokens"])


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def engine_methods(report: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """An ``--engine vllm`` report's comparisons as methods: per heads, each category's tau on ``side``
    ('vllm' or 'headway') and the heads' overall tau from the summed counts (1 + accepted / drafts)."""
    methods: dict[str, dict[str, Any]] = {}
    for c in report["comparisons"]:
        m = methods.setdefault(c["heads"], {"heads": c["heads"], "temperature": 0.0, "categories": {},
                                            "accepted": 0, "drafts": 0})
        counts = c[side]
        m["categories"][c["category"]] = {"tau": float(counts["tau"])}
        m["accepted"] += counts["accepted"]
        m["drafts"] += counts["drafts"]
    for m in methods.values():
        m["tau"] = 1 + m["accepted"] / m["drafts"] if m["drafts"] else 1.0
    return list(methods.values())


def collect(reports: list[dict[str, Any]], rules: list[tuple[re.Pattern[str], str]], key: str, temperature: float,
            side: str = "vllm") -> tuple[list[str], dict[str, dict[str, list[float]]]]:
    """Categories in report order, and group -> category ('all' too) -> one value per method (seed)."""
    categories: list[str] = []
    groups: dict[str, dict[str, list[float]]] = {}
    for report in reports:
        for c in report["suite"]["categories"]:
            if c not in categories:
                categories.append(c)
        methods = engine_methods(report, side) if report.get("engine") == "vllm" else report["methods"]
        for m in methods:
            if not m.get("heads") or m.get("temperature") != temperature:
                continue
            row = groups.setdefault(group_name(m["heads"], rules), {})
            row.setdefault("all", []).append(value(m, key))
            for c, numbers in m["categories"].items():
                row.setdefault(c, []).append(value(numbers, key))
    return categories, groups


def value(entry: dict[str, Any], key: str) -> float:
    if key == "accepted":  # mean drafts accepted per draft step (tau without the bonus token, prefill left out)
        return float(sum(entry["accepted_per_depth"]))
    return float(entry[key])


def table(categories: list[str], groups: dict[str, dict[str, list[float]]]) -> str:
    cols = categories + ["all"]
    lines = ["| heads (seeds) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in groups.items():
        seeds = len(row.get("all", []))
        lines.append(f"| {name} ({seeds}) | " + " | ".join(cell(row.get(c, [])) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="headway eval --json files (of one engine)")
    ap.add_argument("--group", action="append", default=[], metavar="REGEX=LABEL",
                    help="name the heads whose path matches REGEX (first match wins)")
    ap.add_argument("--key", default="tau", help="the number per cell: tau (default), acceptance_length, "
                    "tokens_per_s, speedup, or accepted (drafts accepted per step)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--side", choices=("vllm", "headway"), default="vllm",
                    help="--engine vllm reports: whose counters, vLLM's (default) or headway's decoder's")
    args = ap.parse_args(argv)
    rules = []
    for rule in args.group:
        pattern, sep, label = rule.partition("=")
        if not sep or not label:
            ap.error(f"--group {rule!r}: expected REGEX=LABEL")
        rules.append((re.compile(pattern), label))
    reports = []
    for path in args.reports:
        report = json.loads(path.read_text())
        if report.get("schema") != "headway.eval/1" or report.get("engine") not in ("headway", "vllm"):
            ap.error(f"{path}: not a headway eval report (schema {report.get('schema')!r}, "
                     f"engine {report.get('engine')!r})")
        reports.append(report)
    engines = {r["engine"] for r in reports}
    if len(engines) > 1:
        ap.error("the reports come from both engines (headway and vllm): give one engine's reports per table")
    if engines == {"vllm"} and args.key != "tau":
        ap.error(f"--key {args.key}: an --engine vllm report gives tau only")
    first = sample_of(reports[0])
    for path, report in zip(args.reports[1:], reports[1:]):
        if sample_of(report) != first:
            ap.error(f"{path} asked other questions than {args.reports[0]} (suite, sample or max_new_tokens differ): "
                     "its tau cannot be pooled with theirs")
    categories, groups = collect(reports, rules, args.key, args.temperature, args.side)
    if not groups:
        ap.error(f"no heads were run at temperature {args.temperature:g} in these reports")
    print(table(categories, groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
