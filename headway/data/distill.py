"""``headway distill``: the frozen target writes the answers to a set of prompts (self-distillation).

Output folder (``cfg.output``)::

    headway_distill.json        settings (checked on resume), provenance, counts, complete flag
    shards/shard-XXXXX/         one datasets folder per ``shard_size`` prompts, + shard.json stats
    data-*.arrow, state.json, dataset_info.json   the merged dataset (``load_distilled``)
    token_counts.safetensors    token frequencies over the answers (EAGLE-3 draft vocab)
    .lock                       flock'ed by the process writing the folder (a second writer is refused)

With ``features`` (hf engine), the target's hidden states over every row go to a features folder
as ``headway features`` writes it (one ``shards/shard-XXXXX/features.safetensors`` per shard
until the run finishes): the forwards that write an answer already compute them, so the second
pass over the finished rows that ``headway features`` makes is saved.

Rows: ``index`` (position in the prompt stream), ``id`` (the source row's id), ``input_ids``,
``loss_mask`` (1 exactly on the tokens the target wrote, its stop token included),
``finish_reason`` (``stop`` or ``length``); with ``samples_per_prompt`` N > 1, answer s to prompt i
is row ``index`` i * N + s and carries ``sample`` s. Several processes (``accelerate launch``) split the
shards; the result equals a single-process run.

The answers come from an engine (``cfg.engine``, a ``generation.Generate``): transformers in this
process (``hf``), or vLLM in its own environment (``vllm``, see ``vllm_engine``), which gets the
same prompt ids and stop tokens and writes the same rows through the same code here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .errors import DataError, ResumeMismatchError
from .feature_format import (FORMAT as FEATURES_FORMAT, MANIFEST as FEATURES_MANIFEST, STORE_DTYPES, SUFFIX,
                             features_command, finish_features, layer_indices, pack_shard, parse_layers)
from .generation import FeatureSpec, Generate, hf_generate, stop_token_ids
from .configs import DistillConfig  # noqa: F401  (re-exported; light, for --help)
from .plans import Plan, fit_budget, make_plan, turn_ids
from ..locking import LOCK, output_lock
from ..publish import publish, publishing
from .shards import (check_settings, complete_shards, digest, link_or_copy, owned_shards, read_json, remove_stale,
                     shard_name, shard_ranges, write_json)
from .sources import SourceResult, bad_rows_report, check_source, read_samples, source_paths

MANIFEST = "headway_distill.json"
SHARD_STATS = "shard.json"
SHARD_FEATURES = "features.safetensors"  # in a shard's folder, with --features
FORMAT = "headway-distilled"


@dataclass
class ShardStats:
    rows: int = 0
    dropped: int = 0  # overlong prompts dropped
    truncated: int = 0  # overlong prompts truncated
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    rank: int = 0  # the process that wrote the shard
    engine: str = "hf"  # what wrote it, with its version ("transformers 5.x", "vllm 0.32.0")


@dataclass
class Conversation:
    """A row being written: tokens so far, the loss mask, and how its last answer ended."""

    plan: Plan
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    stop_text: str | None = None
    finish_reason: str = "stop"
    features: dict[str, Any] | None = None  # {key: (len(input_ids), H)}: the last answer's covers the whole row

    def add(self, ids: list[int], written_by_target: bool) -> None:
        self.input_ids += ids
        self.loss_mask += [int(written_by_target)] * len(ids)

    def row(self) -> dict[str, Any]:
        row = {"index": self.plan.index, "id": self.plan.sample.id, "input_ids": self.input_ids,
               "loss_mask": self.loss_mask, "finish_reason": self.finish_reason}
        return row if self.plan.answer is None else {**row, "sample": self.plan.answer}


def batch_seed(seed: int, first_index: int, turn: int) -> int:
    """The RNG seed of one generate() call: fixed by the batch's position, so resumes reproduce it."""
    return (seed * 1_000_003 + first_index * 1_009 + turn) % (2**63)


def distill_batch(generate: Generate, tokenizer: Any, plans: list[Plan], seed: int) -> list[Conversation]:
    """Answer every turn of every plan: turn k of all conversations is one ``generate`` call,
    each conditioned on the conversation's tokens so far (its earlier answers regenerated)."""
    convs = [Conversation(p) for p in plans]
    for c in convs:
        c.add(c.plan.piece_ids[0], False)
    for turn in range(max(len(p.pieces) for p in plans)):
        active = [c for c in convs if len(c.plan.pieces) > turn]
        if turn:
            for c in active:
                c.add(turn_ids(c.plan, turn, tokenizer, c.stop_text), False)
        answers = generate([c.input_ids for c in active], batch_seed(seed, plans[0].index, turn),
                           [batch_seed(seed, c.plan.index, turn) for c in active])
        for c, a in zip(active, answers):
            c.add(a.tokens, True)
            c.features = a.features
            c.stop_text = tokenizer.decode(a.tokens[-1:]) if a.stopped else None
            if not a.stopped:
                c.finish_reason = "length"
    return convs


def distill_shard(generate: Generate, tokenizer: Any, plans: list[Plan | None], cfg: DistillConfig, batch_size: int,
                  on_batch: Callable[[int, int], None], spec: FeatureSpec | None = None, hidden_size: int = 0
                  ) -> tuple[list[dict[str, Any]], ShardStats, dict[str, Any] | None]:
    """Rows, stats and (with ``spec``) the features shard for one shard's plans (already fitted to
    the budget; None = dropped)."""
    stats = ShardStats(dropped=sum(p is None for p in plans))
    kept = [p for p in plans if p is not None]
    stats.truncated = sum(p.truncated for p in kept)
    rows: dict[int, dict[str, Any]] = {}
    feats: dict[int, dict[str, Any]] = {}
    start = time.perf_counter()
    on_batch(stats.dropped, 0)
    for batch in length_batches(kept, batch_size):
        convs = distill_batch(generate, tokenizer, [kept[i] for i in batch], cfg.seed)
        new = sum(sum(c.loss_mask) for c in convs)
        stats.generated_tokens += new
        stats.prompt_tokens += sum(len(c.loss_mask) - sum(c.loss_mask) for c in convs)
        rows.update(zip(batch, (c.row() for c in convs)))
        if spec is not None:
            feats.update(zip(batch, (conversation_features(c, spec) for c in convs)))
        on_batch(len(batch), new)
    stats.rows, stats.seconds = len(rows), time.perf_counter() - start
    ordered = [rows[i] for i in range(len(kept))]
    if spec is None:
        return ordered, stats, None
    empty = torch.zeros(0, hidden_size, dtype=spec.store_dtype)  # a shard whose prompts were all dropped
    parts = {k: [feats[i][k] for i in range(len(kept))] or [empty] for k in spec.layers}
    return ordered, stats, pack_shard(ordered, parts)


def conversation_features(c: Conversation, spec: FeatureSpec) -> dict[str, Any]:
    """A finished row's features, checked: one vector per token, finite in the store dtype."""
    feats = c.features or {}
    for key in spec.layers:
        f = feats.get(key)
        if f is None or f.shape[0] != len(c.input_ids):  # the engine lost track of a token: never store it
            raise RuntimeError(f"row {c.plan.index}: {key} features for {None if f is None else f.shape[0]} of "
                               f"{len(c.input_ids)} tokens")
        if not bool(torch.isfinite(f).all()):
            raise DataError(f"prompt {c.plan.index}: the target's {key} hidden states are NaN/inf, or overflow "
                            f"--feature_store_dtype {str(spec.store_dtype).split('.')[-1]}; nothing of its shard was "
                            "stored. Store them as bfloat16 or float32, or check the target's weights")
    return feats


def length_batches(plans: list[Plan], batch_size: int) -> list[list[int]]:
    """Batches of plan positions, plans of similar first-prompt length together: a batch is
    left-padded to its longest prompt, and in source order SmolLM2's chat prompts (40-105 tokens
    with the system turn) padded ~45% of the prefill's rows (64 of them: 11.9 s of prefill unsorted,
    7.8 s sorted into two batches). Deterministic, so a resumed shard batches alike."""
    order = sorted(range(len(plans)), key=lambda i: len(plans[i].piece_ids[0]))
    return [order[b: b + batch_size] for b in range(0, len(order), batch_size)]


def row_features(sampled: bool = False) -> Any:
    """The rows' columns; ``sampled``: several answers per prompt, each row naming its ``sample``."""
    from datasets import Features, Sequence, Value

    return Features({"index": Value("int64"), "id": Value("string"), "input_ids": Sequence(Value("int32")),
                     "loss_mask": Sequence(Value("int8")), "finish_reason": Value("string"),
                     **({"sample": Value("int32")} if sampled else {})})


def write_shard(folder: Path, j: int, rows: list[dict[str, Any]], stats: ShardStats,
                features: dict[str, Any] | None = None) -> Path:
    """Write shard ``j`` (and its features) under a temporary name, then rename: a shard on disk is
    always complete."""
    from datasets import Dataset

    final = folder / shard_name(j)
    with publishing(final) as tmp:
        if rows:  # datasets can neither write nor read back an empty list: finish skips a shard of no rows
            Dataset.from_list(rows, features=row_features("sample" in rows[0])).save_to_disk(str(tmp))
        else:
            tmp.mkdir()
        if features is not None:
            from safetensors.torch import save_file

            save_file(features, str(tmp / SHARD_FEATURES), metadata={"rows": str(len(rows)),
                                                                      "tokens": str(features["input_ids"].numel())})
        write_json(tmp / SHARD_STATS, asdict(stats))
    return final


def generation_dtype(dtype: str, device: Any) -> str:
    """``auto`` for batched forwards (distill's generation, features' prefill): on a CPU, bf16 where it
    is measured faster than fp32 (native bf16 matmul: generation ~1.8x at batch 64, features ~2.5x),
    else float32; elsewhere the target loader's ``auto``."""
    import torch

    from ..hardware import bf16_is_fast

    if dtype != "auto" or torch.device(device).type != "cpu":
        return dtype
    return "bfloat16" if bf16_is_fast("cpu") else "float32"


def distill(cfg: DistillConfig) -> Path:
    """Distil ``cfg.source`` with ``cfg.target`` into ``cfg.output``; resumable, multi-process aware."""
    from .progress import quiet_datasets

    with quiet_datasets(), contextlib.ExitStack() as hold:  # hold: the output folder's lock, until we return
        return _distill(cfg, hold)


def _distill(cfg: DistillConfig, hold: contextlib.ExitStack) -> Path:
    from ..target import TargetInfo, load_target, load_target_shell, resolve_target_path
    from .chat import load_chat_template
    from .progress import TokenProgress, console
    from .runtime import processes

    out = Path(cfg.output).expanduser()
    check_source(cfg.source)  # a missing prompt file is refused before the target loads and the folder is made
    procs = processes(cfg.device)
    if cfg.engine == "vllm":
        from ..engines.vllm_client import find_vllm_python

        find_vllm_python(cfg.vllm_python)  # a missing vLLM environment fails before anything loads
        if procs.world_size > 1:
            raise DataError("--engine vllm runs in one process (vLLM batches by itself); start it without "
                            "accelerate launch")
    # the resume check sees what runs; vLLM's own bf16 speed is not measured here, so its auto is fp32
    dtype = generation_dtype(cfg.dtype, procs.device) if cfg.engine == "hf" else cfg.dtype.replace("auto", "float32")
    cfg = replace(cfg, dtype=dtype)
    feature_out = Path(cfg.features).expanduser() if cfg.features else None
    inputs = [*source_paths(cfg.source), cfg.target, cfg.adapter, cfg.chat_template]  # never emptied by --overwrite
    if procs.is_main:
        hold.enter_context(output_lock(out, DataError, inputs=inputs))
        prepare_output(out, cfg.overwrite, MANIFEST)
        check_option_settings(out, cfg)  # before the target loads; prompts and template are compared below
        if feature_out is not None:
            if feature_out.resolve() == out.resolve():
                raise DataError(f"--features {feature_out} is the output folder itself; give the features their "
                                "own folder")
            hold.enter_context(output_lock(feature_out, DataError, inputs=inputs))
            prepare_feature_output(feature_out, out, cfg.overwrite)
    procs.barrier()
    with procs.state.main_process_first():
        target_path = resolve_target_path(cfg.target)
    if cfg.engine == "vllm":  # vLLM loads the weights; here only the config, generation config and tokenizer
        model, tokenizer = load_target_shell(target_path, cfg.revision)
    else:
        model, tokenizer = load_target(target_path, cfg.dtype, procs.device, cfg.adapter, cfg.revision)
    template = load_chat_template(tokenizer, cfg.chat_template)
    src = read_samples(cfg.source, split=cfg.split, limit=cfg.limit, skip_bad_rows=cfg.skip_bad_rows,
                       tokenizer=tokenizer, prompt_tokens=cfg.prompt_tokens, seed=cfg.seed, skip=cfg.skip)
    if not src.samples:
        raise DataError(f"no usable prompts in {cfg.source}" + (f" ({len(src.bad)} bad rows; the first: {src.bad[0]})"
                                                                if src.bad else ""))
    check_chat_inputs(src, template, cfg)
    info = TargetInfo.of(model, cfg.target, cfg.revision)
    spec, layers = feature_spec(cfg, info.num_hidden_layers)
    settings = distill_settings(cfg, template, src)
    with procs.state.main_process_first():
        manifest = check_settings(out / MANIFEST, settings, {"format": FORMAT, "target_path": target_path,
                                                            "target_info": asdict(info), "bad_rows": src.bad},
                                  SETTING_DEFAULTS)
    say = console().print if procs.is_main else (lambda *a, **k: None)
    if src.bad:  # file:line text, printed as it is (no markup, no wrapping)
        say(bad_rows_report(src.bad, out / MANIFEST), markup=False, highlight=False, soft_wrap=True)
    if manifest.get("complete"):
        if feature_out is not None and not read_json_or_empty(feature_out / FEATURES_MANIFEST).get("complete"):
            raise DataError(f"{out} is complete but its features folder {feature_out} is not there (the shards they "
                            "came from are gone); make them with: " + features_command(
                                feature_settings(cfg, out, manifest["rows"], layers), feature_out))
        say(f"{out} is already complete ({manifest.get('rows')} rows); nothing to do")
        return out

    shards_dir = out / "shards"
    n = cfg.samples_per_prompt  # answer s to prompt i is row i * n + s
    ranges = shard_ranges(len(src.samples) * n, cfg.shard_size)
    mine = owned_shards(len(ranges), procs.rank, procs.world_size)
    remove_stale(shards_dir, mine)
    done = complete_shards(shards_dir)
    todo = [j for j in mine if j not in done]
    stop_ids = stop_token_ids(model, tokenizer, cfg.stop_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    if done:
        say(f"resuming: {len(done)} of {len(ranges)} shards already done")
    def row_plan(i: int) -> Plan:
        plan = make_plan(i, src.samples[i // n], tokenizer, template, cfg.prompt_format, cfg.target)
        return replace(plan, answer=i % n) if n > 1 else plan

    plans = {j: [fit_budget(row_plan(i), cfg.max_prompt_tokens, cfg.overlong) for i in ranges[j]] for j in todo}
    with answer_engine(cfg, model, target_path, plans, stop_ids, pad_id, out, say, bool(todo), spec) as (generate,
                                                                                                       name):
        with TokenProgress(f"distill [{procs.rank}/{procs.world_size}]" if procs.world_size > 1 else "distill",
                           sum(len(ranges[j]) for j in todo), enabled=procs.is_main, unit="prompts") as bar:
            for j in todo:
                # vLLM batches by itself: a shard's turn is one request (per-row seeds keep rows batch-free)
                batch_size = cfg.batch_size if cfg.engine == "hf" else max(len(plans[j]), 1)
                rows, stats, feats = distill_shard(generate, tokenizer, plans[j], cfg, batch_size, bar.advance, spec,
                                                   info.hidden_size)
                stats.rank, stats.engine = procs.rank, name
                write_shard(shards_dir, j, rows, stats, feats)
    procs.barrier()
    if procs.is_main:
        store = None
        if feature_out is not None and spec is not None:
            def store(shards: dict[int, Path], rows: int, tokens_per_s: float) -> None:
                write_features(shards, feature_out, feature_settings(cfg, out, rows, layers), layers, info,
                               spec.store_dtype, tokens_per_s)
        summary = finish(out, len(ranges), info.vocab_size, manifest, settings, src.bad, procs.world_size, store)
        say(summary_line(summary, out) + (f"; features in {feature_out}" if feature_out is not None else ""))
    procs.barrier()
    return out


@contextlib.contextmanager
def answer_engine(cfg: DistillConfig, model: Any, target_path: str, plans: dict[int, list[Plan | None]],
                  stop_ids: list[int], pad_id: int, out: Path, say: Callable[..., Any],
                  needed: bool, spec: FeatureSpec | None = None) -> Iterator[tuple[Generate, str]]:
    """(generate, "ENGINE VERSION") for this run: transformers on the loaded model (keeping the
    hidden states of ``spec``), or one vLLM engine for all the shards still to do (not started when
    none is)."""
    if cfg.engine == "hf" or not needed:
        import transformers

        from ..kernels import LinearKernels

        kernels = LinearKernels(cfg.linear_kernel, model)
        yield (hf_generate(model, cfg.sampling(), stop_ids, pad_id, kernels, spec),
               f"transformers {transformers.__version__}")
        return
    from ..target import resolve_folder
    from .vllm_engine import vllm_engine

    kept = [p for ps in plans.values() for p in ps if p is not None]
    limit = getattr(model.config, "max_position_embeddings", None)
    with vllm_engine(cfg, resolve_folder(target_path, cfg.revision, what="target"), kept, limit, stop_ids, out,
                     say) as engine:
        yield engine


def prepare_output(out: Path, overwrite: bool, manifest_name: str) -> None:
    """Empty the folder on ``--overwrite``; refuse a non-empty folder that is not ours. The lock
    file stays: this process may hold it."""
    if overwrite and out.is_dir():
        for p in out.iterdir():
            if p.name != LOCK:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    if out.is_dir() and any(p.name != LOCK for p in out.iterdir()) and not (out / manifest_name).is_file():
        raise DataError(f"output folder {out} is not empty and holds no {manifest_name}; "
                        "choose another folder or pass --overwrite")


def check_option_settings(out: Path, cfg: DistillConfig) -> None:
    """Refuse, before the target loads, a folder distilled with other options (``check_settings``
    compares the rest, the prompts and chat template, once they are known)."""
    path = out / MANIFEST
    if not path.is_file():
        return
    manifest = read_json(path)
    old = {**SETTING_DEFAULTS, **manifest.get("settings", {})}
    what = "a finished dataset" if manifest.get("complete") else "an unfinished distill run"
    for key in SETTING_KEYS:
        now = json.loads(json.dumps(setting(cfg, key)))  # lists and tuples as JSON reads them back
        if key in old and old[key] != now:
            hint = ""
            grown = isinstance(old[key], int) and (now is None or now > old[key])
            if key == "limit" and manifest.get("complete") and grown:  # the rest into a new folder, then merge
                done = old[key] + int(old.get("skip") or 0)
                hint = (f"; to add the prompts after these, distil them into a new folder (--skip {done}"
                        + (f" --limit {now - old[key]}" if now is not None else "") + ") and join the two with "
                        f"headway merge {out} NEW --output MERGED")
            if key == "feature_layers" and old[key] is None and manifest.get("complete"):
                hint = (f"; to store the features of this finished dataset, run headway features {out} --layers "
                        + " ".join(map(str, now)) + f" --output {cfg.features}")
            raise ResumeMismatchError(f"{out} holds {what} made with {key}={json.dumps(old[key])}, but this run has "
                                      f"{key}={json.dumps(now)}; rerun with the same settings, choose a new output "
                                      "folder, or pass --overwrite" + hint)


def check_chat_inputs(src: SourceResult, template: str | None, cfg: DistillConfig) -> None:
    """Fail before any generation when chat messages meet a tokenizer without a template."""
    from .chat import require_template

    first_chat = next((s for s in src.samples if s.is_chat), None)
    if first_chat is not None or cfg.prompt_format == "chat":
        row = first_chat.id if first_chat is not None else src.samples[0].id
        require_template(template, cfg.target, f"{cfg.source} (row '{row}')")


# ---------------------------------------------------------------- --features

def feature_spec(cfg: DistillConfig, num_hidden_layers: int) -> tuple[FeatureSpec | None, list[str | int]]:
    """What ``--features`` keeps while generating, and the parsed layers (a bad spec fails here,
    before any generation)."""
    if not cfg.features:
        return None, []
    layers = parse_layers(cfg.feature_layers, num_hidden_layers)
    return FeatureSpec(layer_indices(layers, num_hidden_layers), STORE_DTYPES[cfg.feature_store_dtype]), layers


def prepare_feature_output(folder: Path, out: Path, overwrite: bool) -> None:
    """The ``--features`` folder: empty (``--overwrite`` empties it) or holding features of this very
    dataset (a finished run rerun)."""
    prepare_output(folder, overwrite, FEATURES_MANIFEST)
    made_from = read_json_or_empty(folder / FEATURES_MANIFEST).get("settings", {}).get("dataset")
    if made_from is not None and made_from != str(out.resolve()):
        raise DataError(f"--features {folder} holds the features of another dataset ({made_from}); choose another "
                        "folder or pass --overwrite")


def read_json_or_empty(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def feature_settings(cfg: DistillConfig, out: Path, rows: int, layers: list[str | int]) -> dict[str, Any]:
    """The features folder's settings, as ``headway features`` records them for the same store: the
    two commands describe one format, and rerunning that command on this folder finds it complete."""
    state = out / "state.json"
    return {"dataset": str(out.resolve()), "dataset_state": digest(state.read_text()) if state.is_file() else None,
            "rows": rows, "target": cfg.target, "revision": cfg.revision, "adapter": cfg.adapter, "dtype": cfg.dtype,
            "layers": [str(l) for l in layers], "store_dtype": cfg.feature_store_dtype, "shard_size": cfg.shard_size}


def write_features(shards: dict[int, Path], folder: Path, settings: dict[str, Any], layers: list[str | int],
                   info: Any, store_dtype: torch.dtype, tokens_per_s: float) -> None:
    """Publish the shards' features as a features folder (linked, not copied: the shards go next)."""
    folder.mkdir(parents=True, exist_ok=True)
    for j, shard in sorted(shards.items()):
        src = shard / SHARD_FEATURES
        if not src.is_file():
            raise DataError(f"{shard} holds no {SHARD_FEATURES}: it was written without --features; distil again "
                            "into a new folder, or drop --features and run headway features on the dataset")
        dst = folder / shard_name(j, SUFFIX)
        dst.unlink(missing_ok=True)  # an earlier finish that stopped halfway
        link_or_copy(src, dst)
    manifest = {"format": FEATURES_FORMAT, "version": 1, "written_by": "headway distill", "settings": settings}
    finish_features(folder, len(shards), manifest, layers, info, store_dtype, tokens_per_s)


# the options that decide the rows (with the prompts and the chat template): a resume must match them all
SETTING_KEYS = ("target", "revision", "adapter", "dtype", "source", "split", "skip", "limit", "prompt_tokens",
                "prompt_format", "stop_tokens", "max_prompt_tokens", "overlong", "max_new_tokens", "temperature",
                "top_p", "top_k", "seed", "shard_size", "skip_bad_rows", "engine", "feature_layers",
                "feature_store_dtype", "samples_per_prompt")
# settings a folder written before they were recorded holds, with the value they had then
SETTING_DEFAULTS = {"engine": "hf", "skip": 0, "feature_layers": None, "feature_store_dtype": None,
                    "samples_per_prompt": 1}


def setting(cfg: DistillConfig, key: str) -> Any:
    """A setting's recorded value: the feature options count only with --features (without it the
    shards hold no features, whatever the layer option says)."""
    if key in ("feature_layers", "feature_store_dtype") and not cfg.features:
        return None
    return getattr(cfg, key)


def distill_settings(cfg: DistillConfig, template: str | None, src: SourceResult) -> dict[str, Any]:
    """Everything that decides the rows: a resume must match all of it."""
    prompts = digest(repr([(s.id, s.messages, s.prompt) for s in src.samples]))
    settings = {k: setting(cfg, k) for k in SETTING_KEYS}
    settings["chat_template"] = digest(template) if template else None
    settings["prompts"] = f"{len(src.samples)} rows, sha256 {prompts}"
    return settings


def finish(out: Path, n_shards: int, vocab_size: int, manifest: dict[str, Any], settings: dict[str, Any],
           bad_rows: list[str], world_size: int,
           store: Callable[[dict[int, Path], int, float], None] | None = None) -> dict[str, Any]:
    """Merge the shards into the final dataset, count tokens, ``store`` the features (before the
    folder is marked complete and the shards go), mark the folder complete."""
    from datasets import concatenate_datasets, load_from_disk

    from .vocab import save_token_counts, token_frequencies

    shards = complete_shards(out / "shards")
    missing = [j for j in range(n_shards) if j not in shards]
    if missing:
        raise DataError(f"{out}: shards {missing[:5]} are missing after all processes finished; rerun to resume")
    stats = [read_json(shards[j] / SHARD_STATS) for j in range(n_shards)]
    if not any(s["rows"] for s in stats):
        raise DataError(f"every prompt ({sum(s['dropped'] for s in stats)}) was dropped as longer than "
                        "--max_prompt_tokens; raise it, or pass --overlong truncate")
    # a shard whose prompts were all dropped holds an empty dataset, which datasets cannot load back
    parts = [load_from_disk(str(shards[j])) for j in range(n_shards) if stats[j]["rows"]]
    merged = concatenate_datasets(parts)
    total = {k: sum(s[k] for s in stats) for k in ("rows", "dropped", "truncated", "prompt_tokens",
                                                   "generated_tokens", "seconds")}
    total["bad_rows_skipped"] = len(bad_rows)
    total["bad_rows"] = bad_rows  # every skipped row, "file:line: reason" (the terminal names the first few)
    total["world_size"] = world_size  # of the run that finished (a resumed run may have used another)
    total["shards_by_rank"] = {str(r): sum(s.get("rank", 0) == r for s in stats) for r in range(world_size)}
    total["tokens_per_s"] = round(total["generated_tokens"] / max(total["seconds"], 1e-9), 1)
    total["engines"] = sorted({s.get("engine", "hf") for s in stats})  # with versions; a resume may mix them
    merged.info.description = _provenance(manifest, settings)
    save_merged(merged, out)
    save_token_counts(out, token_frequencies(merged, vocab_size))
    if store is not None:
        row_tokens = total["prompt_tokens"] + total["generated_tokens"]
        store(shards, total["rows"], row_tokens / max(total["seconds"], 1e-9))
    write_json(out / MANIFEST, {**manifest, **total, "complete": True})
    shutil.rmtree(out / "shards", ignore_errors=True)
    return total


def _provenance(manifest: dict[str, Any], settings: dict[str, Any]) -> str:
    import json

    return json.dumps({"headway": FORMAT, "target": settings["target"], "revision": settings["revision"],
                       "target_info": manifest.get("target_info"), "generation": {
                           k: settings[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "engine")},
                       "source": settings["source"]})


def save_merged(ds: Any, out: Path) -> None:
    """``save_to_disk`` into a temporary folder, then move its files into ``out`` (state.json last)."""
    for stale in out.glob(".merged.tmp*"):
        shutil.rmtree(stale)
    tmp = out / f".merged.tmp{os.getpid()}"
    ds.save_to_disk(str(tmp))
    for p in sorted(tmp.iterdir(), key=lambda p: p.name == "state.json"):
        publish(p, out / p.name)
    tmp.rmdir()


def summary_line(total: dict[str, Any], out: Path) -> str:
    extra = [f"{total[k]} {k.replace('_', ' ')}" for k in ("dropped", "truncated", "bad_rows_skipped") if total[k]]
    return (f"distilled {total['rows']} rows into {out}: {total['generated_tokens']} generated tokens at "
            f"{total['tokens_per_s']:.0f} tok/s" + (f" ({', '.join(extra)})" if extra else ""))


def load_distilled(path: str | Path) -> Any:
    """The dataset of a finished ``distill`` (or ``tokenize``) run: columns ``input_ids``, ``loss_mask``, ..."""
    from datasets import load_from_disk

    path = Path(path).expanduser()
    manifest = next((path / m for m in (MANIFEST, "headway_tokenize.json") if (path / m).is_file()), None)
    if manifest is not None and not read_json(manifest).get("complete"):
        raise DataError(f"{path} is an unfinished run; rerun the same command to complete it")
    if not (path / "state.json").is_file():
        raise DataError(f"{path} is not a distilled dataset folder (no state.json)")
    ds = load_from_disk(str(path))
    for col in ("input_ids", "loss_mask"):
        if col not in ds.column_names:
            raise DataError(f"{path} has no '{col}' column (columns: {', '.join(ds.column_names)})")
    return ds


def distill_cli(cfg: DistillConfig) -> int:
    distill(cfg)
    return 0

