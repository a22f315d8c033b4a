"""The "peers at their best" protocol (issue #59 item 4) as data: which runs, in which order, what each
costs, and how their scores become one table (standard library only; sweep.py executes it).

Runs (``plan``), one at a time, each tool on the same prepared answers:

- headway: its recipe (``--config``), one run per seed.
- each peer in the ``own`` mode (its own defaults, defaults.py) and the ``shared`` mode (headway's
  settings: draft vocabulary, TTT length, epochs, headway's LR), one run per seed.
- the strongest peer (speculators, docs/peers.md) in the ``own`` mode also gets an LR bracket: stage 1
  trains every ``--lr`` at the first seed; stage 2 trains the other seeds at the LR whose stage-1 run
  scored the highest tau on the dev set. The test set never picks anything.

Scores: every run on every evaluation set; per setting (tool, mode, LR) the mean, sample standard
deviation, min and max over its seeds (``spread``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

import defaults

BEST = "best"  # a stage-2 LR: the stage-1 LR that scored the highest dev tau
DEV = "dev"  # the evaluation set choices read (stage 2's LR)
METRICS = ("tau", "tau_decode")

# Rough CPU minutes (one core) per epoch of the 1,536 SmolLM2 answers (267,732 tokens) at the shared settings,
# from the runs in docs/peers.md: headway 285 s on 2 threads for 2 epochs (bf16, AMX); speculators 28 min on
# 1 thread for 2 epochs (fp32); SpecForge 29:56 on 1 thread for 2 epochs (bf16); ModelOpt ~28 s a step on a
# shared core, ~90 min for 2 epochs (fp32, stopped).
REFERENCE_TOKENS = 267_732
CPU_MIN_PER_EPOCH = {"headway": 4.75, "speculators": 14.0, "specforge": 15.0, "modelopt": 45.0}
# Tokens/s of a tool at its own defaults, measured alone on 2 threads under one wall-clock timer
# (benchmarks/peers/throughput.py; benchmarks/results/peers-throughput-epyc.json, warm). The shared rates above
# scaled to own settings overestimated these two (SpecForge 1.5x, ModelOpt 2.4x: the preset layer's
# multiply-adds are not where its time goes), so an own-mode run at these settings is estimated from them.
OWN_TOKENS_PER_S_2T = {"specforge": 153.9, "modelopt": 89.0}
SMOLLM2 = {"hidden": 576, "intermediate": 1536, "q_dim": 576, "kv_dim": 192}  # 9 heads of 64, 3 KV heads
MODELOPT_PRESET = {"intermediate": 14336, "q_dim": 32 * 128, "kv_dim": 8 * 128}  # eagle3_default_config


@dataclass(frozen=True)
class Job:
    """One training run. ``lr`` None: the tool's (or the recipe's) own; ``BEST``: resolved after stage 1."""

    tool: str
    mode: str  # "recipe" (headway), "own" or "shared"
    lr: float | str | None
    seed: int
    stage: int = 1

    @property
    def setting(self) -> str:
        """The row of the results table: the seeds of one setting are averaged."""
        return f"{self.tool} {self.mode} lr {_lr(self.lr)}"

    @property
    def name(self) -> str:
        """The run's folder name (stable: resumption finds a finished run by it)."""
        if self.lr == BEST:
            raise ValueError(f"{self.tool} {self.mode} seed {self.seed}: its LR is chosen after stage 1")
        return f"{self.tool}-{self.mode}-lr{_lr(self.lr)}-s{self.seed}"


def _lr(lr: float | str | None) -> str:
    return "own" if lr is None else lr if isinstance(lr, str) else format(lr, "g")


def plan(seeds: list[int], bracket: list[float], tools: list[str] | None = None,
         bracketed: str = "speculators") -> list[Job]:
    """Every run of the protocol, in the order it runs: headway, then each peer's own and shared modes
    (whole settings before the next), the LR bracket's stage 2 last."""
    tools = tools or list(defaults.TOOLS)
    if not seeds:
        raise ValueError("at least one seed")
    jobs: list[Job] = []
    for tool in tools:
        if tool == "headway":
            jobs += [Job(tool, "recipe", None, s) for s in seeds]
            continue
        if tool == bracketed and bracket:
            jobs += [Job(tool, "own", lr, seeds[0]) for lr in bracket]
            jobs += [Job(tool, "own", BEST, s, stage=2) for s in seeds[1:]]
        else:
            jobs += [Job(tool, "own", None, s) for s in seeds]
        jobs += [Job(tool, "shared", defaults.RECOMMENDED_LR["headway"], s) for s in seeds]
    return sorted(jobs, key=lambda j: j.stage)  # stable: stage 2 after every stage-1 run


def best_lr(dev_tau: dict[float, float]) -> float:
    """The LR with the highest dev tau (ties: the smaller LR)."""
    if not dev_tau:
        raise ValueError("no scored stage-1 run to choose an LR from")
    return max(sorted(dev_tau), key=lambda lr: dev_tau[lr])


def resolve(jobs: list[Job], dev_tau: dict[tuple[str, str, float], float]) -> list[Job]:
    """Stage-2 jobs with the LR their stage 1 chose; a job whose stage 1 is not fully scored stays ``BEST``.
    ``dev_tau``: {(tool, mode, lr): dev tau} of the scored stage-1 runs."""
    out = []
    for job in jobs:
        if job.lr == BEST:
            bracket = [j.lr for j in jobs if (j.tool, j.mode, j.stage) == (job.tool, job.mode, 1)]
            scored = {lr: dev_tau[(job.tool, job.mode, lr)] for lr in bracket if (job.tool, job.mode, lr) in dev_tau}
            if bracket and len(scored) == len(bracket):
                job = replace(job, lr=best_lr(scored))
        out.append(job)
    return out


# ---------------------------------------------------------------- cost estimate

def macs_per_position(hidden: int, intermediate: int, q_dim: int, kv_dim: int, draft_vocab: int) -> int:
    """Multiply-adds of one EAGLE-3 step at one position: fc (3H -> H), the layer's attention projections
    and MLP, the draft lm_head. Attention scores are left out (short rows)."""
    attention = hidden * (2 * q_dim + 2 * kv_dim)  # q, o and k, v
    return 3 * hidden * hidden + attention + 3 * hidden * intermediate + hidden * draft_vocab


def cost_factor(tool: str, settings: dict[str, Any], ttt_steps: int, shared_vocab: int) -> float:
    """Compute of ``settings`` relative to the shared mode's (per token and epoch): TTT length x per-step
    multiply-adds (draft vocabulary, and ModelOpt's preset layer). Precision is left out."""
    layer = dict(SMOLLM2)
    if settings.get("draft_layer") == "preset":
        layer.update(MODELOPT_PRESET)
    base = macs_per_position(**SMOLLM2, draft_vocab=shared_vocab)
    return ttt_steps / 3 * macs_per_position(**layer, draft_vocab=settings["draft_vocab_size"]) / base


def cpu_minutes(job: Job, settings: dict[str, Any] | None, tokens: int, shared_vocab: int,
                headway_epochs: float) -> float:
    """Expected CPU minutes (core-minutes) of ``job``: the reference rate x epochs x tokens x cost factor."""
    per_epoch = CPU_MIN_PER_EPOCH[job.tool] * tokens / REFERENCE_TOKENS
    if job.tool == "headway" or settings is None:
        return per_epoch * headway_epochs
    opts = settings["options"]
    epochs = float(opts[defaults.option(job.tool, "epochs")])
    ttt = int(opts.get(defaults.option(job.tool, "ttt_steps"), defaults.OWN[job.tool]["ttt_steps"][0]))
    if job.mode == "own" and job.tool in OWN_TOKENS_PER_S_2T:  # measured at these settings: 2 cores' minutes
        return 2 * tokens * epochs / OWN_TOKENS_PER_S_2T[job.tool] / 60
    return per_epoch * epochs * cost_factor(job.tool, settings, ttt, shared_vocab)


# ---------------------------------------------------------------- the table

def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one seed), min and max, and how many."""
    if not values:
        raise ValueError("no values")
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def aggregate(scored: list[tuple[Job, dict[str, dict[str, Any]]]], eval_names: list[str]) -> dict[str, Any]:
    """[(job, {set: its evaluate.py result})] -> {setting: {tool, mode, lr, seeds, set: {metric: spread}}}.
    A job missing a set's score counts for the sets it has."""
    raw: dict[str, Any] = {}
    for job, results in scored:
        entry = raw.setdefault(job.setting, {"tool": job.tool, "mode": job.mode, "lr": job.lr, "seeds": [],
                                             "_values": {}})
        entry["seeds"].append(job.seed)
        for name in eval_names:
            r = results.get(name)
            if r is None:
                continue
            values = entry["_values"].setdefault(name, {})
            for m in METRICS:
                if r.get(m) is not None:
                    values.setdefault(m, []).append(float(r[m]))
            for d, v in enumerate(r.get("top1") or []):
                values.setdefault(f"top1_d{d + 1}", []).append(float(v))
    for entry in raw.values():
        for name, values in entry.pop("_values").items():
            entry[name] = {m: spread(v) for m, v in values.items()}
    return raw


def markdown(summary: dict[str, Any], eval_names: list[str]) -> str:
    """One row per setting: mean ± std over seeds of tau and tau_decode on each set, top-1 at depths 1-3
    on the first set."""
    cols = [f"{n} {m}" for n in eval_names for m in METRICS]
    lines = ["| setting | seeds | " + " | ".join(cols) + f" | {eval_names[0]} top-1 depth 1..3 |",
             "|---|---|" + "---|" * (len(cols) + 1)]
    for setting, e in summary.items():
        cells = []
        for n in eval_names:
            for m in METRICS:
                s = e.get(n, {}).get(m)
                cells.append(f"{s['mean']:.3f} ± {s['std']:.3f} (n={s['n']})" if s else "–")
        top = e.get(eval_names[0], {})
        top1 = " ".join(f"{top[k]['mean']:.3f}" for k in ("top1_d1", "top1_d2", "top1_d3") if k in top) or "–"
        lines.append(f"| {setting} | {','.join(map(str, e['seeds']))} | " + " | ".join(cells) + f" | {top1} |")
    return "\n".join(lines) + "\n"
