"""The README.md model card written next to every heads checkpoint."""

from __future__ import annotations

import json
from typing import Any

import yaml

_TITLES = {"medusa": "Medusa heads", "eagle1": "EAGLE-1 drafter", "eagle3": "EAGLE-3 drafter"}


def model_card(cfg: dict[str, Any]) -> str:
    """YAML front matter the Hub reads, then what the heads are, how they were trained and how well they draft."""
    kind = cfg["kind"]
    target = cfg.get("target") or {}
    meta = cfg.get("metadata") or {}
    front = {"library_name": "headway", "tags": ["speculative-decoding", kind], "pipeline_tag": "text-generation"}
    if target.get("name_or_path"):
        front["base_model"] = target["name_or_path"]
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {_TITLES.get(kind, kind)} for {target.get('name_or_path') or 'a causal LM'}", "",
             f"Draft module for speculative decoding, trained with headway {cfg.get('headway_version', '')} on a "
             "frozen target. The target's output is unchanged: the draft only proposes tokens the target verifies.", "",
             "## Target", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in target.items()]
    if meta.get("training"):
        lines += ["", "## Training", "", "```json", json.dumps(meta["training"], indent=2), "```"]
    if meta.get("eval"):
        lines += ["", "## Measured acceptance (held-out data)", "", "```json", json.dumps(meta["eval"], indent=2), "```"]
    if meta.get("decode"):
        lines += ["", "## Decoding", "", "```json", json.dumps(meta["decode"], indent=2), "```"]
    lines += ["", "## Use", "", "```python", "from headway.decode import Speculator",
              f"spec = Speculator.from_pretrained({target.get('name_or_path', 'TARGET')!r}, 'THIS_REPO')",
              "print(spec.generate('def fib(n):', max_new_tokens=64).text)", "```", ""]
    return "\n".join(lines)
