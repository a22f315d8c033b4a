"""One adapt round: prompts -> tau before -> answers -> continued training -> tau after -> the gate.

``Round(...).run()`` runs the steps a round's state (``state.RoundState``) does not record as
done, each resuming by itself (``headway prompts`` by batch, ``headway distill`` by shard,
``headway train`` from its latest checkpoint), records each result, and then decides: the new
heads are published (a new generation, copied onto ``--out`` atomically) when their tau on the
held-out prompts beats the served heads' by ``threshold``; otherwise ``--out`` is not touched,
not even read. The decision is taken again on every run until a round publishes, so a rejected
round rerun with a lower threshold publishes without redoing anything.

The round starts from a copy of the served heads (``base/``): a round resumed after ``--out``
changed (it is often ``--heads`` itself) still continues, and measures, the heads it started from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..heads.files import is_heads_checkpoint
from .configs import AdaptConfig
from .errors import AdaptError
from .state import RoundState, next_round_folder

BASE, DISTILL, FEATURES, TRAIN = "base", "distill", "features", "train"


@dataclass
class Outcome:
    round: str
    accepted: bool | None = None  # None: stopped before the gate
    tau_before: float | None = None
    tau_after: float | None = None
    generation: int | None = None  # the generation published (accepted)
    stopped: str | None = None  # the step the round stopped after (stop_after, or training's own stop)


class Round:
    """A round of ``cfg`` in ``state.folder``, starting from the heads at ``base_src``."""

    def __init__(self, cfg: AdaptConfig, work: Path, state: RoundState, base_src: Path, now: float) -> None:
        self.cfg, self.work, self.state, self.base_src, self.now = cfg, work, state, base_src, now
        self.folder = state.folder
        self.loaded: tuple[Any, Any] | None = None

    @property
    def base(self) -> Path:
        return self.folder / BASE

    @property
    def final(self) -> Path:
        return self.folder / TRAIN / "final"

    def target(self) -> tuple[Any, Any]:
        """(model, tokenizer): the target the gate measures on and training runs with, loaded once."""
        if self.loaded is None:
            from ..target import load_target, resolve_target_path

            cfg = self.cfg
            self.loaded = load_target(resolve_target_path(cfg.target), adapter=cfg.adapter, revision=cfg.revision,
                                      **cfg.load_kwargs())
        return self.loaded

    # -- the steps ---------------------------------------------------------------------------------
    def run(self, rows: list[dict[str, Any]] | None = None, info: dict[str, Any] | None = None) -> Outcome:
        from .generations import copy_heads

        if not is_heads_checkpoint(self.base):
            copy_heads(self.base_src, self.base)
        steps = (("prompts", lambda: self.prompts(rows, info or {})), ("before", lambda: self.measure(self.base)),
                 ("distill", self.distill), ("train", self.train), ("after", self.after))
        for name, step in steps:
            if not self.state.done(name):
                result = step()
                if result is None:  # training stopped early on purpose (train.stop_after)
                    return self.stopped(name)
                self.state.record(name, result)
            if self.cfg.stop_after == name:
                return self.stopped(name)
        return self.decide()

    def stopped(self, step: str) -> Outcome:
        print(f"adapt {self.state.name}: stopped after the {step} step; rerun the same command to resume", flush=True)
        return Outcome(self.state.name, stopped=step)

    def prompts(self, rows: list[dict[str, Any]] | None, info: dict[str, Any]) -> dict[str, Any]:
        from .prompts import SELF_FOLDER, rows_digest, self_rows, source_rows, traffic_rows, write_split

        start = time.perf_counter()
        if rows is None:
            kind = self.cfg.source_kind()
            rows, info = (self_rows(self.cfg, self.folder / SELF_FOLDER) if kind == "self" else
                          traffic_rows(self.cfg, self.now) if kind == "traffic" else
                          source_rows(self.cfg, self.target()[1]))
        counts = write_split(self.folder, rows, self.cfg)
        print(f"adapt {self.state.name}: {counts['total']} prompts from {info.get('source')}: {counts['train']} to "
              f"train on, {counts['heldout']} held out for the gate", flush=True)
        return {**info, **counts, "digest": rows_digest(rows), "seconds": round(time.perf_counter() - start, 2)}

    def measure(self, heads: Path) -> dict[str, Any]:
        from ..data.chat import load_chat_template
        from .measure import decoder_tau, heldout_ids
        from .prompts import HELDOUT, read_rows

        cfg = self.cfg
        model, tok = self.target()
        template = load_chat_template(tok, cfg.chat_template)
        room = int(getattr(model.config, "max_position_embeddings", None) or 1 << 30) - cfg.gate.max_new_tokens
        ids = heldout_ids(read_rows(self.folder / HELDOUT), tok, template, cfg.prompt_format, cfg.target, room)
        result = decoder_tau(model, tok, heads, ids, cfg.gate.max_new_tokens, cfg.gate.tree).to_dict()
        which = "the served heads" if heads == self.base else "the new heads"
        print(f"adapt {self.state.name}: tau {result['tau']:.3f} for {which} on {result['prompts']} held-out prompts "
              f"({result['new_tokens']} tokens, {result['forwards']} target forwards)", flush=True)
        return result

    def train_config(self) -> Any:
        from ..train.contracts import CONTRACTS
        from .training import train_config

        tc = train_config(self.cfg, self.base, self.folder / DISTILL, None, self.folder / TRAIN)
        if self.cfg.distill.features and CONTRACTS[tc.kind].offline:
            tc = replace(tc, features=str(self.folder / FEATURES))
        return tc

    def distill(self) -> dict[str, Any]:
        from ..data.configs import DistillConfig
        from ..data.distill import MANIFEST, distill
        from ..data.shards import read_json
        from .prompts import TRAIN as TRAIN_PROMPTS
        from .training import feature_layers

        cfg, d = self.cfg, self.cfg.distill
        tc = self.train_config()
        layers = feature_layers(tc, int(self.target()[0].config.num_hidden_layers)) if tc.features else None
        dc = DistillConfig(source=str(self.folder / TRAIN_PROMPTS), target=cfg.target, revision=cfg.revision,
                           adapter=cfg.adapter, dtype=d.dtype, device=cfg.device, output=str(self.folder / DISTILL),
                           chat_template=cfg.chat_template, prompt_format=cfg.prompt_format,
                           stop_tokens=list(cfg.stop_tokens), max_prompt_tokens=d.max_prompt_tokens,
                           max_new_tokens=d.max_new_tokens, temperature=d.temperature, seed=cfg.seed,
                           batch_size=d.batch_size, shard_size=d.shard_size, features=tc.features,
                           feature_layers=layers or ["final"], feature_store_dtype=d.feature_store_dtype)
        manifest = read_json(distill(dc) / MANIFEST)
        keys = ("rows", "dropped", "prompt_tokens", "generated_tokens", "seconds", "tokens_per_s")
        return {**{k: manifest.get(k) for k in keys}, "features": layers}

    def train(self) -> dict[str, Any] | None:
        from ..heads.metadata import read_metadata
        from ..train.recipe import fit

        model, tok = self.target()
        fit(self.train_config(), model, tok)
        if not is_heads_checkpoint(self.final):
            return None
        meta = read_metadata(self.final)
        training, ev = meta.get("training") or {}, meta.get("eval") or {}
        return {"kind": training.get("kind"), "steps": training.get("steps"), "tokens": training.get("tokens"),
                "train_time_s": training.get("train_time_s"), "train_rows": training.get("train_rows"),
                "eval": {k: ev[k] for k in ("tau", "tau_decode") if k in ev}}

    def after(self) -> dict[str, Any]:
        result = self.measure(self.final)
        result["same_output"] = result["output_digest"] == self.state.steps["before"]["output_digest"]
        if not result["same_output"]:  # greedy speculative output is the target's: a decoder fault, or float ties
            print(f"adapt {self.state.name}: warning: the two heads' greedy outputs differ on the held-out prompts; "
                  "both should equal the target's", flush=True)
        return result

    # -- the gate ------------------------------------------------------------------------------------
    def decide(self) -> Outcome:
        from . import generations

        steps, cfg = self.state.steps, self.cfg
        before, after = steps["before"]["tau"], steps["after"]["tau"]
        out = Outcome(self.state.name, tau_before=before, tau_after=after)
        gain = after / before - 1.0
        line = (f"tau {before:.3f} -> {after:.3f} ({gain:+.1%}; threshold {cfg.threshold:.1%}) on "
                f"{steps['after']['prompts']} held-out prompts")
        if self.state.done("published"):
            out.accepted, out.generation = True, steps["published"]["generation"]
            print(f"adapt {self.state.name}: already published as generation {out.generation} ({line})", flush=True)
            return out
        out.accepted = after >= before * (1.0 + cfg.threshold)
        self.state.record("decision", {"accepted": out.accepted, "gain": round(gain, 4), "threshold": cfg.threshold})
        if not out.accepted:
            print(f"adapt {self.state.name}: kept the served heads: {line}; {cfg.out} was not touched (the trained "
                  f"heads stay in {self.final})", flush=True)
            return out
        served = generations.served_generation(self.work)
        if served is None:  # the heads served before adapt's first publication: generation 0, for rollback
            served = generations.add(self.work, self.base, f"{self.state.name}:base",
                                     {"round": None, "tau": before, "note": f"served before adapt ({self.base_src})"},
                                     None)["generation"]
        lineage = self.lineage(gain, served)
        made = generations.add(self.work, self.final, f"{self.state.name}:new",
                               {"round": self.state.name, "tau_before": before, "tau": after, "base_generation": served},
                               lineage)
        generations.serve(self.work, made["generation"], Path(cfg.out).expanduser())
        generations.prune(self.work, cfg.traffic.keep_generations)
        self.state.record("published", {"generation": made["generation"], "out": str(cfg.out),
                                        "at": generations.now_iso()})
        out.generation = made["generation"]
        print(f"adapt {self.state.name}: published generation {out.generation} to {cfg.out}: {line}", flush=True)
        return out

    def lineage(self, gain: float, base_generation: int) -> dict[str, Any]:
        """``metadata["adapt"]`` of the published heads: where they come from and what they cost."""
        from .generations import now_iso

        cfg, s = self.cfg, self.state.steps
        p, d, t, b, a = s["prompts"], s["distill"], s["train"], s["before"], s["after"]
        prompts = {k: p[k] for k in ("source", "total", "train", "heldout", "traffic", "self_prompts") if k in p}
        compute = {"prompts_s": p.get("seconds"), "distill_s": round(d.get("seconds") or 0.0, 2), "distill_tokens": d.get("generated_tokens"),
                   "distill_prompt_tokens": d.get("prompt_tokens"), "train_s": t.get("train_time_s"),
                   "train_tokens": t.get("tokens"), "train_steps": t.get("steps"),
                   "gate_s": round(b["seconds"] + a["seconds"], 2)}
        compute["total_s"] = round(sum(v for k, v in compute.items() if k.endswith("_s") and v), 2)
        measured = (f"headway's decoder, greedy, {cfg.gate.max_new_tokens} new tokens per prompt, tree "
                    f"{cfg.gate.tree or 'the default for the kind'}, on {a['prompts']} held-out prompts")
        return {"base_heads": str(self.base_src), "base_generation": base_generation, "round": self.state.name,
                "target": cfg.target, "adapter": cfg.adapter,
                "prompts": {**prompts, "distilled_rows": d.get("rows"), "seed": cfg.seed},
                "tau": {"before": round(b["tau"], 4), "after": round(a["tau"], 4), "gain": round(gain, 4),
                        "threshold": cfg.threshold, "measured": measured, "same_output": a.get("same_output"),
                        "before_detail": b, "after_detail": {k: v for k, v in a.items() if k != "same_output"}},
                "training_eval": t.get("eval"), "compute": compute, "created": now_iso()}


def check_out(out: Path) -> None:
    """``--out`` is absent, an empty folder or heads: adapt never replaces anything else."""
    if out.exists() and not (is_heads_checkpoint(out) or (out.is_dir() and not any(out.iterdir()))):
        raise AdaptError(f"--out {out} holds something other than heads; adapt publishes only over heads (or into "
                         "a new folder): choose another --out")


def preflight(cfg: AdaptConfig) -> None:
    """What can fail before a round starts, checked before one does: a fix would change the round's
    settings, which an unfinished round refuses. --out, the target's folder (a built-in target builds),
    the gate's tree."""
    check_out(Path(cfg.out).expanduser())
    cfg.target_path()
    if cfg.gate.tree:
        from ..decode.shapes import parse_shape

        parse_shape(cfg.gate.tree)


def base_heads(cfg: AdaptConfig) -> Path:
    """The heads a new round starts from: --heads, or with --watch the served heads once there are some;
    heads a round cannot continue (Medusa-2, an unknown kind, a recipe of another kind) are refused now."""
    from .training import base_settings, heads_record

    out = Path(cfg.out).expanduser()
    heads = out if cfg.watch and is_heads_checkpoint(out) else Path(cfg.heads or "").expanduser()
    if not cfg.heads and heads != out:
        raise AdaptError(f"--out {out} holds no heads yet: give --heads, the heads to start from")
    if not is_heads_checkpoint(heads):
        raise AdaptError(f"--heads {heads} is not a headway heads folder (config.json and model.safetensors)")
    base_settings(*heads_record(heads), cfg.train.recipe)
    return heads


def start_round(cfg: AdaptConfig, work: Path, settings: dict[str, Any], base: Path, now: float,
                rows: list[dict[str, Any]] | None, info: dict[str, Any]) -> Outcome:
    state = RoundState.start(next_round_folder(work), settings)
    return Round(cfg, work, state, base, now).run(rows, info)
