"""The README.md model card written next to every heads checkpoint.

YAML front matter the Hub reads (``library_name: headway``, ``tags: [speculative-decoding, <kind>]``,
``pipeline_tag``, and ``base_model`` when the target is a Hub repo id — the Hub rejects a local
path there), then the target, a summary of the training data, the measured acceptance, and usage.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

_TITLES = {"medusa": "Medusa heads", "eagle1": "EAGLE-1 drafter", "eagle3": "EAGLE-3 drafter"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name: str | None) -> bool:
    return bool(name) and bool(_HUB_ID.match(name)) and ".." not in name


def front_matter(cfg: dict[str, Any]) -> dict[str, Any]:
    target = (cfg.get("target") or {}).get("name_or_path")
    front: dict[str, Any] = {"library_name": "headway", "tags": ["speculative-decoding", cfg["kind"]],
                             "pipeline_tag": "text-generation"}
    if is_hub_id(target):
        front["base_model"] = target
    return front


def _json_block(title: str, data: Any) -> list[str]:
    return ["", f"<details><summary>{title}</summary>", "", "```json", json.dumps(data, indent=2), "```",
            "", "</details>"]


def training_section(training: dict[str, Any]) -> list[str]:
    rows = [("data", training.get("data")), ("training rows", training.get("train_rows")),
            ("tokens", training.get("tokens")), ("steps", training.get("steps")),
            ("global batch", training.get("global_batch")), ("processes", training.get("world_size")),
            ("time (s)", training.get("train_time_s")), ("final loss", training.get("final_loss"))]
    lines = ["", "## Training data", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    return lines + _json_block("all training settings", training)


def acceptance_section(ev: dict[str, Any]) -> list[str]:
    lines = ["", "## Measured acceptance (held-out data)", ""]
    if "tau" in ev:
        lines.append(f"tau (tokens per target forward, bonus included): **{float(ev['tau']):.3f}**"
                     + (f" over {ev['positions']} positions" if "positions" in ev else ""))
    by_depth = ev.get("accept_rate_by_depth") or ev.get("top1")
    if by_depth:
        name = "acceptance rate" if "accept_rate_by_depth" in ev else "top-1 accuracy"
        lines += ["", f"| depth | {name} |", "|---|---|"]
        lines += [f"| {d + 1} | {float(v):.3f} |" for d, v in enumerate(by_depth)]
    return lines + _json_block("all evaluation numbers", ev)


def model_card(cfg: dict[str, Any]) -> str:
    """Front matter, then what the heads are, how they were trained and how well they draft."""
    kind = cfg["kind"]
    target = cfg.get("target") or {}
    meta = cfg.get("metadata") or {}
    lines = ["---", yaml.safe_dump(front_matter(cfg), sort_keys=False).strip(), "---", "",
             f"# {_TITLES.get(kind, kind)} for {target.get('name_or_path') or 'a causal LM'}", "",
             f"Draft module for speculative decoding, trained with headway {cfg.get('headway_version', '')} on a "
             "frozen target. The target's output is unchanged: the draft only proposes tokens the target verifies.", "",
             "## Target", "", "| field | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in target.items()]
    if meta.get("training"):
        lines += training_section(meta["training"])
    if meta.get("eval"):
        lines += acceptance_section(meta["eval"])
    if meta.get("decode"):
        lines += ["", "## Decoding", "", "```json", json.dumps(meta["decode"], indent=2), "```"]
    lines += ["", "## Use", "", "```python", "from headway.decode import Speculator",
              f"spec = Speculator.from_pretrained({target.get('name_or_path', 'TARGET')!r}, 'THIS_REPO')",
              "print(spec.generate('def fib(n):', max_new_tokens=64).text)", "```", "",
              "Engines: `headway export THIS_REPO --format vllm|sglang|trtllm --out DIR`.", ""]
    return "\n".join(lines)
