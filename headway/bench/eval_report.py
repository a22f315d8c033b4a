"""``headway eval`` results: the per-category terminal tables, the plot, and the entries the heads'
model cards keep (``metadata["suites"]``, rendered by ``heads/card.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from ..optional import need
from .report import save_figure

CARD_KEYS = ("prompts", "tau", "accepted_per_depth", "tokens_per_s", "speedup", "speedup_same_kernel", "exact_match")


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _positions(rates: list[float], n: int = 6) -> str:
    return " ".join(f"{a:.2f}" for a in rates[:n]) + (" …" if len(rates) > n else "") if rates else "-"


def _title(report: dict[str, Any]) -> str:
    from rich.markup import escape

    s, t = report["suite"], report["target"]
    n_q = sum(c["questions"] for c in s["categories"].values())
    n_p = sum(c["prompts"] for c in s["categories"].values())
    sample = f", {s['per_category']} per category (seed {s['seed']})" if s["per_category"] else ""
    return (f"headway eval {s['name']}: {escape(Path(t['path']).name)} ({t['parameters'] / 1e6:.1f}M params, "
            f"{t['dtype']}) · {n_q} questions{sample}, {n_p} prompts ({escape(s['prompt_format'])}) × "
            f"{report['settings']['max_new_tokens']} new tokens")


def _source_note(report: dict[str, Any]) -> str:
    from rich.markup import escape

    s = report["suite"]
    canonical = {True: "the canonical file", False: "NOT the canonical file", None: "no file checksum"}[s["canonical"]]
    return f"questions: {escape(s['source'])} ({canonical}; {escape(s['license'])})"


def render_eval_table(report: dict[str, Any]) -> Any:
    """One row per method and category (then the method over all of them), per temperature."""
    from rich.markup import escape
    from rich.table import Table

    caption = ("τ = new tokens / target forwards (prefill included, as headway bench) · accept by position = share of "
               "draft steps accepting draft position k · × HF = median per-repeat tokens/s ratio to HF generate · "
               "× kernel = the same against hf-weight-major (HF generate with the decoder's linear kernel) · "
               f"exact = T=0 outputs equal to HF greedy · target greedy 4-gram repetition "
               f"{report['repetition_rate']:.1%} · {_source_note(report)}")
    table = Table(title=_title(report) + f" × {report['settings']['repeats']} repeats", caption=caption,
                  caption_justify="left")
    for col, just in (("method", "left"), ("T", "right"), ("category", "left"), ("prompts", "right"),
                      ("τ", "right"), ("accept by position", "left"), ("tok/s", "right"), ("× HF", "right"),
                      ("× kernel", "right"), ("exact", "right")):
        table.add_column(col, justify=just, no_wrap=col in ("method", "category", "accept by position"))
    for m in report["methods"]:
        rows = [*m["categories"].items(), ("all", {**m, "prompts": sum(e["prompts"] for e in m["categories"].values())})]
        for category, e in rows:
            exact = "n/a" if e["exact_match"] is None else f"{e['exact_match']:.0%}"
            style = "red" if e["exact_match"] is not None and e["exact_match"] < 1 else "bold" if category == "all" \
                else None
            table.add_row(escape(m["name"]), f"{m['temperature']:g}", escape(category), str(e["prompts"]),
                          f"{e['tau']:.2f}", _positions(e["accepted_per_depth"]), f"{e['tokens_per_s']:.1f}",
                          _x(e["speedup"]), _x(e["speedup_same_kernel"]), exact, style=style)
        table.add_section()
    return table


def render_vllm_table(report: dict[str, Any]) -> Any:
    """One row per heads checkpoint and category: both engines' τ and acceptance by position."""
    from rich.markup import escape
    from rich.table import Table

    v = report["vllm"]
    rule = f"acceptance rates within {v['tolerance']:g}" if v["tolerance"] else "equal counts"
    caption = (f"vLLM {v['version']} (float32, greedy) against headway's decoder on the same prompts, both drafting "
               "a chain of k · τ = 1 + accepted / drafts (bonus included, prefill left out; vLLM's spec-decode "
               f"counters) · agree: {rule} and outputs equal to the target's greedy · {_source_note(report)}")
    table = Table(title=_title(report) + " · headway and vLLM", caption=caption, caption_justify="left")
    for col, just in (("heads", "left"), ("category", "left"), ("prompts", "right"), ("k", "right"),
                      ("τ headway", "right"), ("τ vLLM", "right"), ("accept by position: headway | vLLM", "left"),
                      ("vLLM tok/s", "right"), ("agree", "left")):
        table.add_column(col, justify=just, no_wrap=col != "agree")
    for c in report["comparisons"]:
        h, v_ = c["headway"], c["vllm"]
        table.add_row(escape(c["heads_name"]), escape(c["category"]), str(c["prompts"]), str(c["k"]),
                      _f(h["tau"], ".3f"), _f(v_["tau"], ".3f"),
                      f"{_positions(h['rate_per_position'])} | {_positions(v_['rate_per_position'])}",
                      _f(c["vllm_tokens_per_s"], ".1f"), "yes" if c["ok"] else "NO", style=None if c["ok"] else "red")
    return table


# ---------------------------------------------------------------------------------------------
# Plot


def _bars(ax: Any, categories: list[str], series: dict[str, list[float | None]], ylabel: str, title: str) -> None:
    width = 0.8 / max(1, len(series))
    for j, (label, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=label)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if series:
        ax.legend(fontsize=7)


def _plot_series(report: dict[str, Any]) -> tuple[list[str], dict[str, list], dict[str, list], dict[str, list]]:
    """(categories, τ per series, speedup per series, acceptance by position per category of the first series)."""
    cats = list(report["suite"]["categories"])
    tau, speed, by_pos = {}, {}, {}
    if report["engine"] == "vllm":
        for c in report["comparisons"]:
            for engine in ("headway", "vllm"):
                tau.setdefault(f"{c['heads_name']} {engine}", []).append(c[engine]["tau"])
            if c["heads_name"] == report["comparisons"][0]["heads_name"]:
                by_pos[c["category"]] = c["vllm"]["rate_per_position"]
        return cats, tau, speed, by_pos
    heads = [m for m in report["methods"] if m["heads"] is not None]
    for m in heads:
        label = f"{m['name']} T={m['temperature']:g}"
        tau[label] = [m["categories"][c]["tau"] for c in cats]
        speed[label] = [m["categories"][c]["speedup"] for c in cats]
    if heads:
        by_pos = {c: heads[0]["categories"][c]["accepted_per_depth"] for c in cats}
    return cats, tau, speed, by_pos


def write_eval_plot(report: dict[str, Any], path: str | Path) -> Path:
    """τ by category, speedup against HF generate by category (headway engine), acceptance by draft
    position per category. ``MissingDependency`` without matplotlib (the ``plot`` extra)."""
    matplotlib = need("matplotlib", "the eval plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats, tau, speed, by_pos = _plot_series(report)
    panels = 3 if speed else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.8))
    _bars(axes[0], cats, tau, "τ", f"{report['suite']['name']}: τ by category")
    if speed:
        _bars(axes[1], cats, speed, "speedup vs HF generate", "speedup by category")
        axes[1].axhline(1.0, color="grey", lw=0.8, ls=":")
    ax = axes[-1]
    for i, (category, rates) in enumerate(by_pos.items()):
        ax.plot(range(1, len(rates) + 1), rates, marker="o", color=f"C{i % 10}", label=category)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of draft steps accepting it")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance by position" + (" (vLLM)" if report["engine"] == "vllm" else ""))
    if ax.lines:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------
# Model cards


def card_key(report: dict[str, Any]) -> str:
    """The suite's entry in ``metadata["suites"]``: one per suite and engine, the latest run's."""
    return report["suite"]["name"] + ("@vllm" if report["engine"] == "vllm" else "")


def card_entry(report: dict[str, Any], heads: str) -> dict[str, Any] | None:
    """What the model card of ``heads`` keeps of this run (None when the run did not decode with it)."""
    s, settings = report["suite"], report["settings"]
    entry: dict[str, Any] = {
        "suite": s["name"], "engine": report["engine"], "created": report["created"], "source": s["source"],
        "canonical": s["canonical"], "url": s["url"], "per_category": s["per_category"], "seed": s["seed"],
        "questions": sum(c["questions"] for c in s["categories"].values()), "max_new_tokens": settings["max_new_tokens"],
        "target": report["target"]["path"], "threads": settings["threads"]}
    if report["engine"] == "vllm":
        rows = [{k: c[k] for k in ("category", "prompts", "k", "ok")} | {"tau_headway": c["headway"]["tau"],
                "tau_vllm": c["vllm"]["tau"], "rate_per_position_vllm": c["vllm"]["rate_per_position"]}
                for c in report["comparisons"] if c["heads"] == heads]
        return entry | {"vllm_version": report["vllm"]["version"], "comparisons": rows} if rows else None
    methods = [{"name": m["name"], "tree": m["tree"], "temperature": m["temperature"],
                "all": {k: m[k] for k in CARD_KEYS if k != "prompts"} | {"prompts": sum(
                    e["prompts"] for e in m["categories"].values())},
                "categories": {c: {k: e[k] for k in CARD_KEYS} for c, e in m["categories"].items()}}
               for m in report["methods"] if m["heads"] == heads]
    return entry | {"methods": methods} if methods else None


def store_in_cards(report: dict[str, Any]) -> Iterator[str]:
    """Record the run with every local heads checkpoint it decoded with (``metadata["suites"]`` in
    config.json, then its model card); yields one line per checkpoint saying what was written."""
    from ..heads.card import refresh_card
    from ..heads.metadata import read_metadata, update_metadata

    for heads in report["settings"]["heads"]:
        entry = card_entry(report, heads)
        folder = Path(heads).expanduser()
        if entry is None:
            continue
        if not folder.is_dir():
            yield f"{heads}: not a local folder (a Hub id?): nothing stored"
            continue
        suites = dict(read_metadata(folder).get("suites") or {})
        suites[card_key(report)] = entry
        update_metadata(folder, {"suites": suites})
        wrote = refresh_card(folder)
        yield f"{folder / 'config.json'} ({'and ' + str(wrote) if wrote else 'README.md is not a headway card: left as is'})"
