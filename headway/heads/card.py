"""The README.md model card written next to every heads checkpoint.

YAML front matter the Hub reads (``library_name: headway``, ``tags: [speculative-decoding, <kind>]``,
``license``, and ``base_model`` when the target is a Hub repo id — the Hub rejects a local path
there; no ``pipeline_tag``: heads cannot generate on their own), then the target, a summary of
the training data, the measured acceptance, and usage.

A card never shows an absolute local path (a target is often a folder such as
``~/.cache/headway/targets/smollm2-0.1.2``): a local target is named by its folder's last
component. The card saved with the checkpoint names the heads ``path/to/these/heads``;
``headway push`` writes it again with the repo id (``model_card(cfg, repo_id=...)``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import yaml

_TITLES = {"medusa": "Medusa heads", "eagle1": "EAGLE-1 drafter", "eagle3": "EAGLE-3 drafter",
           "dflash": "DFlash block drafter", "peagle": "P-EAGLE parallel drafter"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_ABSOLUTE = re.compile(r"^(?:/|~|[A-Za-z]:[\\/]|\\\\)")  # POSIX, home, Windows drive or UNC
LOCAL_HEADS = "path/to/these/heads"  # the saved card's name for the heads; push puts the repo id there
OTHER_LICENSE = "other"


def is_hub_id(name: str | None) -> bool:
    return bool(name) and bool(_HUB_ID.match(name)) and ".." not in name


def is_absolute_path(value: str) -> bool:
    return bool(_ABSOLUTE.match(value))


def _pure(path: str) -> PurePosixPath | PureWindowsPath:
    return PureWindowsPath(path) if "\\" in path else PurePosixPath(path)


def last_component(path: str) -> str:
    """``/root/.cache/headway/targets/smollm2-0.1.2`` -> ``smollm2-0.1.2`` (POSIX or Windows)."""
    return _pure(path).name or path.strip("/\\~") or "target"


def scrub_paths(value: Any) -> Any:
    """``value`` with every string that is an absolute local path replaced by its last component."""
    if isinstance(value, str):
        return last_component(value) if is_absolute_path(value) else value
    if isinstance(value, dict):
        return {k: scrub_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_paths(v) for v in value]
    return value


@dataclass(frozen=True)
class TargetView:
    """How the card names a target: never by a local path."""

    label: str  # the title and the target table: a Hub id, or a local folder's last component
    load_as: str  # what the usage snippet passes to Speculator.from_pretrained
    base_model: str | None  # front matter: Hub ids only
    license: str | None  # the heads' license when headway knows it, else None (-> "other")
    note: str | None = None  # one sentence on where the target comes from


def target_view(name_or_path: str | None) -> TargetView:
    if not name_or_path:
        return TargetView("a causal LM", "path/to/target", None, None)
    if is_hub_id(name_or_path):
        return TargetView(name_or_path, name_or_path, name_or_path, None)
    from ..target import DEMO_LICENSE, DEMO_PRESETS, NAMED_TARGETS

    label = last_component(name_or_path)
    in_cache = _pure(name_or_path).parent.name == "targets"  # built by headway: <cache>/targets/<name>
    for spec in NAMED_TARGETS.values():
        if name_or_path == spec.name or in_cache and label == f"{spec.name}-{spec.version}":
            license = spec.license.lower() if re.fullmatch(r"[A-Za-z0-9.-]+", spec.license) else None
            return TargetView(label, spec.name, None, license,
                              f"headway's named target `{spec.name}`: {spec.model}, converted from the GGUF of the "
                              f"`{spec.package}` {spec.version} wheel (`headway target build {spec.name}`)")
    if name_or_path == "demo" or in_cache and label.split("-")[0] in DEMO_PRESETS:
        load_as = "demo" if label == "demo" or label.startswith("demo-") else f"path/to/{label}"
        return TargetView(label, load_as, None, DEMO_LICENSE,
                          "headway's demo target, a small Llama trained on the Python standard library's source "
                          "(`headway target build`)")
    return TargetView(label, f"path/to/{label}", None, None)


def card_license(cfg: dict[str, Any], license: str | None = None) -> str:
    """The license the card states: the one given, else the target's when headway knows it, else "other"."""
    return license or target_view((cfg.get("target") or {}).get("name_or_path")).license or OTHER_LICENSE


# Equal to huggingface_hub's ModelCardData(library_name=, license=, tags=, base_model=).to_dict(); a plain dict
# keeps this module free of the Hub client (switching is left to this file's owner, with the export rework).
def front_matter(cfg: dict[str, Any], license: str | None = None) -> dict[str, Any]:
    view = target_view((cfg.get("target") or {}).get("name_or_path"))
    front: dict[str, Any] = {"library_name": "headway", "license": card_license(cfg, license),
                             "tags": ["speculative-decoding", cfg["kind"]]}
    if view.base_model:
        front["base_model"] = view.base_model
    return front


def _json_block(title: str, data: Any) -> list[str]:
    return ["", f"<details><summary>{title}</summary>", "", "```json", json.dumps(scrub_paths(data), indent=2),
            "```", "", "</details>"]


def training_section(training: dict[str, Any]) -> list[str]:
    rows = [("data", training.get("data")), ("training rows", training.get("train_rows")),
            ("tokens", training.get("tokens")), ("steps", training.get("steps")),
            ("global batch", training.get("global_batch")), ("processes", training.get("world_size")),
            ("time (s)", training.get("train_time_s")), ("final loss", training.get("final_loss"))]
    lines = ["", "## Training data", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {scrub_paths(v)} |" for k, v in rows if v is not None]
    return lines + _json_block("all training settings", training)


def acceptance_section(ev: dict[str, Any]) -> list[str]:
    lines = ["", "## Measured acceptance (held-out data)", ""]
    if "tau" in ev:
        lines.append(f"tau (tokens per target forward, bonus included): **{float(ev['tau']):.3f}**"
                     + (f" over {ev['positions']} positions" if "positions" in ev else ""))
    if "tau_decode" in ev:
        lines.append(f"tau where a greedy chain decoder's steps start (what `headway bench` measures): "
                     f"**{float(ev['tau_decode']):.3f}** over {ev.get('decode_steps')} steps")
    by_depth = ev.get("accept_rate_by_depth") or ev.get("top1")
    if by_depth:
        name = "acceptance rate" if "accept_rate_by_depth" in ev else "top-1 accuracy"
        lines += ["", f"| depth | {name} |", "|---|---|"]
        lines += [f"| {d + 1} | {float(v):.3f} |" for d, v in enumerate(by_depth)]
    return lines + _json_block("all evaluation numbers", ev)


def _num(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else format(float(value), spec) + suffix


def _by_position(rates: list[float] | None) -> str:
    return " / ".join(f"{float(r):.2f}" for r in rates) if rates else "-"


def _suite_table(categories: dict[str, Any], overall: dict[str, Any] | None) -> list[str]:
    lines = ["| category | prompts | τ | acceptance by position | tokens/s | × HF generate | × same kernel |",
             "|---|---|---|---|---|---|---|"]
    rows = list(categories.items()) + ([("**all**", overall)] if overall else [])
    for name, e in rows:
        lines.append(f"| {name} | {e.get('prompts', '')} | {_num(e.get('tau'))} | {_by_position(e.get('accepted_per_depth'))} "
                     f"| {_num(e.get('tokens_per_s'), '.1f')} | {_num(e.get('speedup'), '.2f', '×')} "
                     f"| {_num(e.get('speedup_same_kernel'), '.2f', '×')} |")
    return lines


def suites_section(suites: dict[str, Any]) -> list[str]:
    """The standard suites' per-category tables that ``headway eval`` stored (``metadata["suites"]``)."""
    lines = ["", "## Standard suites", "",
             "Measured with `headway eval`: τ is new tokens per target forward (bonus included); speedups are "
             "tokens/s against HF `generate` and against HF `generate` with the decoder's few-row linear kernel "
             "(the same-kernel baseline), on the machine named below."]
    for s in suites.values():
        if not isinstance(s, dict):
            continue
        engine = " in vLLM" if s.get("engine") == "vllm" else ""
        sample = f", {s['per_category']} per category (seed {s.get('seed')})" if s.get("per_category") else ""
        canonical = {True: "the canonical file", False: "not the canonical file"}.get(s.get("canonical"), "")
        lines += ["", f"### {s.get('suite')}{engine}", "",
                  f"{s.get('questions')} questions{sample} from {last_component(str(s.get('source', '')))}"
                  + (f" ({canonical})" if canonical else "") + f", {s.get('max_new_tokens')} new tokens, "
                  f"{s.get('threads')} threads, {s.get('created')}."]
        for m in s.get("methods") or []:
            lines += ["", f"`{m.get('name')}` at T={m.get('temperature')}:", ""]
            lines += _suite_table(m.get("categories") or {}, m.get("all"))
        if s.get("comparisons"):
            lines += ["", f"vLLM {s.get('vllm_version')} against headway's decoder (greedy chains of k; τ = 1 + "
                          "accepted / drafts):", "",
                      "| category | prompts | k | τ headway | τ vLLM | vLLM acceptance by position | agree |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {c.get('category')} | {c.get('prompts')} | {c.get('k')} | {_num(c.get('tau_headway'), '.3f')} "
                      f"| {_num(c.get('tau_vllm'), '.3f')} | {_by_position(c.get('rate_per_position_vllm'))} "
                      f"| {'yes' if c.get('ok') else 'no'} |" for c in s["comparisons"]]
    return lines


def _number(value: Any) -> str | None:
    return f"{float(value):.3f}" if isinstance(value, (int, float)) else None


def adapt_section(adapt: dict[str, Any]) -> list[str]:
    """``headway adapt``'s lineage: the heads these continue, the prompts, tau before and after, the compute."""
    prompts, tau, compute = adapt.get("prompts") or {}, adapt.get("tau") or {}, adapt.get("compute") or {}
    rows = [("continued from", adapt.get("base_heads")), ("generation", adapt.get("generation")),
            ("prompts", prompts.get("source")),
            ("prompts (training / held out)", f"{prompts.get('train')} / {prompts.get('heldout')}" if prompts else None),
            ("tau before (served heads)", _number(tau.get("before"))), ("tau after (these heads)", _number(tau.get("after"))),
            ("gain (threshold)", f"{tau['gain']:+.1%} ({tau.get('threshold', 0):.1%})" if "gain" in tau else None),
            ("distillation", f"{compute.get('distill_s')} s, {compute.get('distill_tokens')} tokens written"
             if compute else None),
            ("training", f"{compute.get('train_s')} s, {compute.get('train_tokens')} tokens" if compute else None)]
    lines = ["", "## Adaptation (`headway adapt`)", "",
             "Continued from served heads on new prompts and published because tau on a held-out slice of them "
             "(never trained on) improved by the threshold: " + str(tau.get("measured", "")) + ".", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {scrub_paths(v) if isinstance(v, str) else v} |" for k, v in rows if v is not None]
    return lines + _json_block("the whole lineage", adapt)


def license_section(license: str, view: TargetView) -> list[str]:
    if license == OTHER_LICENSE:
        text = (f"`other`: these weights are derived from the target ({view.label}); check the target model's "
                "license before using or redistributing them. `headway push --license ID` states one.")
    elif license == view.license:
        text = f"`{license}`, the license of the target ({view.label})."
    else:
        text = f"`{license}`."
    return ["", "## License", "", text]


def model_card(cfg: dict[str, Any], repo_id: str | None = None, license: str | None = None) -> str:
    """Front matter, then what the heads are, how they were trained and how well they draft.
    ``repo_id``: the Hub repository the card is pushed to (named in the usage lines)."""
    kind = cfg["kind"]
    target = cfg.get("target") or {}
    meta = cfg.get("metadata") or {}
    view = target_view(target.get("name_or_path"))
    heads = repo_id or LOCAL_HEADS
    license = card_license(cfg, license)
    lines = ["---", yaml.safe_dump(front_matter(cfg, license), sort_keys=False).strip(), "---", "",
             f"# {_TITLES.get(kind, kind)} for {view.label}", "",
             f"Draft module for speculative decoding, trained with headway {cfg.get('headway_version', '')} on a "
             "frozen target. The target's output is unchanged: the draft only proposes tokens the target verifies. "
             "It cannot generate on its own: load it together with its target.", "",
             "## Target", ""]
    if view.note:
        lines += [f"The target is {view.note}.", ""]
    lines += ["| field | value |", "|---|---|"]
    lines += [f"| {k} | {view.label if k == 'name_or_path' else scrub_paths(v)} |" for k, v in target.items()]
    if meta.get("training"):
        lines += training_section(meta["training"])
    if meta.get("eval"):
        lines += acceptance_section(meta["eval"])
    if meta.get("suites"):
        lines += suites_section(meta["suites"])
    if meta.get("adapt"):
        lines += adapt_section(meta["adapt"])
    if meta.get("decode"):
        lines += ["", "## Decoding", "", "```json", json.dumps(scrub_paths(meta["decode"]), indent=2), "```"]
    lines += ["", "## Use", "", "```python", "from headway.decode import Speculator", "",
              f"spec = Speculator.from_pretrained({json.dumps(view.load_as)}, {json.dumps(heads)})",
              'print(spec.generate("def fib(n):", max_new_tokens=64).text)', "```", "",
              f"Engines: `headway export {heads} --format vllm|sglang|trtllm|speculators --out DIR`."]
    lines += license_section(license, view)
    return "\n".join(lines) + "\n"


def refresh_card(heads_dir: str | Path) -> Path | None:
    """Write the checkpoint's README.md again from its config.json (after ``update_metadata``), when
    the README there is headway's own card (or missing); a card of the user's own is left as it is
    (None). The weights are not touched."""
    from ..publish import write_text
    from .files import read_config

    folder = Path(heads_dir).expanduser()
    readme = folder / "README.md"
    if readme.is_file() and "library_name: headway" not in readme.read_text(encoding="utf-8", errors="replace")[:400]:
        return None
    write_text(readme, model_card(read_config(folder)))
    return readme


def export_card(cfg: dict[str, Any], readme: str, repo_id: str | None = None, license: str | None = None) -> str:
    """The card of an engine export (``headway export``, its ``headway`` block in ``cfg``): Hub front
    matter (tags: kind and engine format), then the export's own README with the repo id in its load
    lines (``THIS_FOLDER``) and the target named without a local path."""
    h = cfg["headway"]
    name = (h.get("target") or {}).get("name_or_path")
    view = target_view(name)
    license = license or view.license or OTHER_LICENSE
    front: dict[str, Any] = {"library_name": "headway", "license": license,
                             "tags": ["speculative-decoding", h["kind"], h["format"]]}
    if view.base_model:
        front["base_model"] = view.base_model
    body = readme.replace("THIS_FOLDER", repo_id or "THIS_FOLDER")
    if name and is_absolute_path(name):
        body = body.replace(name, view.label)
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "", body.rstrip()]
    lines += license_section(license, view)
    return "\n".join(lines) + "\n"
