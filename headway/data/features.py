"""``headway features``: the target's hidden states over a distilled dataset (EAGLE offline mode).

Layers are named as HF ``hidden_states`` indices (0 = the embeddings, i = the output of decoder
layer i, which is the input of layer i + 1), plus ``final``: the final hidden state after the
model's last norm (= ``output_hidden_states[-1]`` in transformers v5), what Medusa and
EAGLE-1 read. ``eagle3`` expands to EAGLE-3's defaults (2, L//2, L-3); ``headway train
features=DIR`` also needs ``final`` for EAGLE's soft labels (``--layers eagle3 final``).

Output folder::

    features.json              manifest: layers, keys, dtype, target, shards (file, rows, tokens), bytes/token
    shard-XXXXX.safetensors    per layer key one (tokens, H) tensor for all rows of the shard, concatenated;
                               input_ids (tokens,) int32, loss_mask (tokens,) int8,
                               offsets (rows + 1,) int64 and index (rows,) int64 (dataset rows);
                               with --topk_logits K also topk_values (tokens, K) float32 and
                               topk_indices (tokens, K) int32: the target's K largest logits where
                               the next token is an answer token (zeros elsewhere)
    .lock                      flock'ed by the process writing the folder (a second writer is refused)

``target_features`` is the one function that computes features, here and in online training.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from .configs import FeaturesConfig  # noqa: F401  (re-exported; light, for --help)
from ..compat import hidden_states_arg
from ..publish import publishing
from .errors import DataError
# the folder's format (re-exported: this module documents the folder)
from .feature_format import (FORMAT, MANIFEST, STORE_DTYPES, SUFFIX, TOPK_INDICES, TOPK_KEYS,  # noqa: F401
                             TOPK_VALUES, dataset_rows, eagle3_layers, feature_keys, features_command, finish_features,
                             layer_indices, layer_key, pack_shard, parse_layers)
from .shards import (check_settings, complete_shards, digest, owned_shards, read_json, remove_stale, shard_name,
                     shard_ranges)


# ---------------------------------------------------------------- computing

def target_features(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    layers: Sequence[str | int]) -> dict[str, torch.Tensor]:
    """Hidden states of ``layers`` for a batch: {layer_key: (B, T, H)}.

    ``final`` is the post-norm final hidden state; integers index HF ``hidden_states``. The LM
    head is not run. Used both by ``headway features`` and by online training.
    """
    index = layer_indices(layers, model.config.get_text_config().num_hidden_layers)
    with torch.inference_mode():
        out = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                               output_hidden_states=hidden_states_arg(index.values()), use_cache=False)
    hidden = out.hidden_states  # L + 1 entries, None where not requested
    return {k: hidden[i] for k, i in index.items()}  # each (B, T, H)


# ---------------------------------------------------------------- writing

def right_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T), padded on the right (positions start at 0)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def shard_tensors(model: nn.Module, rows: list[dict[str, Any]], layers: Sequence[str | int],
                  store_dtype: torch.dtype, batch_size: int, pad_id: int,
                  on_batch: Any = None, topk: int = 0) -> dict[str, torch.Tensor]:
    """All tensors of one shard: per key the rows' (T_i, H) features concatenated to (sum T_i, H); with
    ``topk``, also the target's top-k logits per token (``TOPK_KEYS``, (sum T_i, k) each)."""
    device = next(model.parameters()).device
    keys = feature_keys(layers, topk)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    asked = list(layers) + (["final"] if topk and "final" not in layers else [])  # top-k logits read `final`
    head = TopkLogits(model, topk) if topk else None
    for b in range(0, len(rows), batch_size):
        batch = [r["input_ids"] for r in rows[b: b + batch_size]]
        ids, mask = right_pad(batch, pad_id, device)  # (B, T)
        feats = target_features(model, ids, mask, asked)
        if head is not None:
            used = next_is_answer([r["loss_mask"] for r in rows[b: b + batch_size]], ids.shape[1]).to(device)
            feats.update(head(feats["final"], used))
        for k in keys:
            f = feats[k]
            if k in TOPK_KEYS:
                parts[k] += [f[i, : len(r)].cpu() for i, r in enumerate(batch)]  # each (T_i, k), as computed
                continue
            stored = [f[i, : len(r)].to("cpu", store_dtype) for i, r in enumerate(batch)]  # each (T_i, H)
            for i, x in enumerate(stored):
                check_finite_row(x, f[i, : len(batch[i])], k, rows[b + i].get("index", b + i))
            parts[k] += stored
        if on_batch is not None:
            on_batch(len(batch), sum(len(r) for r in batch))
    return pack_shard(rows, parts)


def next_is_answer(loss_masks: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """(B, width) bool: position s is followed by an answer token (loss_mask[s + 1] == 1): where
    training reads the target's logits (they predict that token)."""
    out = torch.zeros(len(loss_masks), width, dtype=torch.bool)
    for i, m in enumerate(loss_masks):
        nxt = torch.tensor(list(m[1:width]), dtype=torch.bool)  # (len - 1,)
        out[i, : nxt.numel()] = nxt
    return out


class TopkLogits:
    """The target's K largest logits of a batch's post-norm final states, in float32: the lm_head's
    own output (a logit soft-cap or scale the target's forward applies after it is monotonic, so
    the same K tokens lead; training applies it to the values). The float32 weight is made once."""

    def __init__(self, model: nn.Module, k: int, chunk: int = 512) -> None:
        head = model.get_output_embeddings()
        if k > head.weight.shape[0]:
            raise DataError(f"--topk_logits {k} is more than the target's vocabulary ({head.weight.shape[0]} tokens)")
        self.weight = head.weight.detach().float()  # (V, H)
        bias = getattr(head, "bias", None)
        self.bias = bias.detach().float() if bias is not None else None
        self.k, self.chunk = k, chunk

    @torch.inference_mode()
    def __call__(self, final: torch.Tensor, used: torch.Tensor) -> dict[str, torch.Tensor]:
        """final (B, T, H), used (B, T) bool -> {TOPK_VALUES: (B, T, k) float32, TOPK_INDICES: (B, T, k)
        int32}, zeros where ``used`` is False (nothing reads them; the projection is skipped there)."""
        B, T, _ = final.shape
        values = torch.zeros(B, T, self.k, dtype=torch.float32, device=final.device)
        indices = torch.zeros(B, T, self.k, dtype=torch.int32, device=final.device)
        x = final[used].to(self.weight.device, torch.float32)  # (N, H)
        vs, ids = [], []
        for c in x.split(self.chunk):
            top = nn.functional.linear(c, self.weight, self.bias).topk(self.k, dim=-1)  # sorted, largest first
            vs.append(top.values)
            ids.append(top.indices.to(torch.int32))
        if vs:
            values[used] = torch.cat(vs).to(final.device)
            indices[used] = torch.cat(ids).to(final.device)
        return {TOPK_VALUES: values, TOPK_INDICES: indices}


def check_finite_row(stored: torch.Tensor, computed: torch.Tensor, key: str, row: int) -> None:
    """Refuse to store NaN/inf features: training on them would only fail later, far from the cause.
    ``stored`` (T, H) is the row in the store dtype, ``computed`` the same row as the target gave it."""
    if bool(torch.isfinite(stored).all()):
        return
    if bool(torch.isfinite(computed).all()):
        raise DataError(f"dataset row {row}: the target's {key} hidden states overflow --store_dtype "
                        f"{str(stored.dtype).split('.')[-1]} (max |x| {float(computed.abs().max()):.3g}); "
                        "store them as bfloat16 or float32")
    raise DataError(f"dataset row {row}: the target's {key} hidden states are NaN/inf; nothing of its shard was "
                    "stored. Check the target's weights, or run it in another --dtype (float16 overflows)")


def write_feature_shard(folder: Path, j: int, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    final = folder / shard_name(j, SUFFIX)
    meta = {"rows": str(tensors["index"].numel()), "tokens": str(tensors["input_ids"].numel())}
    with publishing(final) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return final


def features(cfg: FeaturesConfig) -> Path:
    """Compute and store the features of ``cfg.dataset``; resumable, multi-process aware."""
    with contextlib.ExitStack() as hold:  # hold: the output folder's lock, until we return
        return _features(cfg, hold)


def _features(cfg: FeaturesConfig, hold: contextlib.ExitStack) -> Path:
    from ..target import TargetInfo, load_target
    from ..locking import output_lock
    from .distill import MANIFEST as DISTILL_MANIFEST, generation_dtype, load_distilled, prepare_output
    from .progress import TokenProgress, console
    from .runtime import processes
    from ..target import resolve_target_path

    out = Path(cfg.output).expanduser()
    data_path = Path(cfg.dataset).expanduser().resolve()
    ds = load_distilled(data_path)
    if cfg.limit is not None:
        ds = ds.select(range(min(cfg.limit, len(ds))))
    target, revision = dataset_target(data_path, DISTILL_MANIFEST, cfg)
    procs = processes(cfg.device)
    # auto takes bf16 where this CPU runs it natively (a batched forward, like distill's): the resolved
    # dtype is what the settings record, so a resume elsewhere cannot mix dtypes in one folder
    cfg = replace(cfg, dtype=generation_dtype(cfg.dtype, procs.device))
    if procs.is_main:
        hold.enter_context(output_lock(out, DataError, inputs=[data_path, cfg.target, cfg.adapter]))
        prepare_output(out, cfg.overwrite, MANIFEST)
    procs.barrier()
    with procs.state.main_process_first():
        target_path = resolve_target_path(target)
    model, tokenizer = load_target(target_path, cfg.dtype, procs.device, cfg.adapter, revision)
    info = TargetInfo.of(model, target, revision)
    layers = parse_layers(cfg.layers, info.num_hidden_layers)
    settings = {"dataset": str(data_path), "dataset_state": digest((data_path / "state.json").read_text()),
                "rows": len(ds), "target": target, "revision": revision, "adapter": cfg.adapter, "dtype": cfg.dtype,
                "layers": [str(l) for l in layers], "store_dtype": cfg.store_dtype, "shard_size": cfg.shard_size}
    if cfg.topk_logits:  # recorded only when asked: folders without it keep the settings they always had
        settings["topk_logits"] = cfg.topk_logits
    with procs.state.main_process_first():
        manifest = check_settings(out / MANIFEST, settings, {"format": FORMAT, "version": 1})
    say = console().print if procs.is_main else (lambda *a, **k: None)
    if manifest.get("complete"):
        say(f"{out} is already complete ({manifest['num_rows']} rows); nothing to do")
        return out
    ranges = shard_ranges(len(ds), cfg.shard_size)
    mine = owned_shards(len(ranges), procs.rank, procs.world_size)
    remove_stale(out, mine)
    done = complete_shards(out, SUFFIX)
    todo = [j for j in mine if j not in done]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    store_dtype = STORE_DTYPES[cfg.store_dtype]
    with TokenProgress("features", sum(len(ranges[j]) for j in todo), enabled=procs.is_main) as bar:
        for j in todo:
            rows = ds.select(ranges[j]).to_list()
            write_feature_shard(out, j, shard_tensors(model, rows, layers, store_dtype, cfg.batch_size, pad_id,
                                                      bar.advance, cfg.topk_logits))
    procs.barrier()
    if procs.is_main:
        final = finish_features(out, len(ranges), manifest, layers, info, store_dtype, bar.tokens_per_s,
                                cfg.topk_logits)
        say(f"features of {final['num_rows']} rows ({final['num_tokens']} tokens) in {out}: "
            f"{final['bytes_per_token']:.0f} bytes/token, {bar.tokens_per_s:.0f} tok/s")
    procs.barrier()
    return out


def dataset_target(data_path: Path, manifest_name: str, cfg: FeaturesConfig) -> tuple[str, str | None]:
    """The target to use: ``cfg.target``, else the one recorded by ``headway distill``."""
    if cfg.target:
        return cfg.target, cfg.revision
    manifest = data_path / manifest_name
    if manifest.is_file():
        settings = read_json(manifest).get("settings", {})
        return settings["target"], cfg.revision or settings.get("revision")
    raise DataError(f"{data_path} does not record its target; pass --target")


# ---------------------------------------------------------------- reading

def read_features_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a features folder, finished or not (``FeatureStore`` needs a finished one)."""
    path = Path(path).expanduser()
    if not (path / MANIFEST).is_file():
        raise DataError(f"{path} holds no {MANIFEST}; make it with headway features DATASET --output {path}")
    return read_json(path / MANIFEST)


class FeatureStore:
    """Read stored features row by row: ``store[i]`` -> {key: (T, H), "input_ids": (T,), "loss_mask": (T,)}.

    Rows are in dataset order; ``store.keys`` are the feature keys (e.g. ``final``,
    ``hidden_states.2``). Files are memory-mapped; only the asked row is read.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not (self.path / MANIFEST).is_file():
            raise DataError(f"{self.path} holds no {MANIFEST}; run headway features first")
        self.manifest = read_json(self.path / MANIFEST)
        if not self.manifest.get("complete"):
            raise DataError(f"{self.path} is an unfinished features run; rerun the same command to complete it")
        self.keys: list[str] = list(self.manifest["keys"])
        self.shards = self.manifest["shards"]
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["rows"])
        self._open: dict[int, tuple[Any, torch.Tensor]] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def _shard(self, j: int) -> tuple[Any, torch.Tensor]:
        if j not in self._open:
            from safetensors import safe_open

            f = safe_open(str(self.path / self.shards[j]["file"]), "pt")
            self._open[j] = (f, f.get_tensor("offsets"))
        return self._open[j]

    def lengths(self) -> list[int]:
        """Every row's token count, from the shards' offsets (no feature is read)."""
        out: list[int] = []
        for j in range(len(self.shards)):
            out += self._shard(j)[1].diff().tolist()
        return out

    def __getstate__(self) -> dict[str, Any]:
        """Open files stay behind when the store is pickled (DataLoader workers open their own)."""
        return {**self.__dict__, "_open": {}}

    def row(self, i: int, keys: Sequence[str] | None = None, max_length: int | None = None) -> dict[str, Any]:
        """Row ``i`` reading only ``keys`` (default: all) and at most ``max_length`` tokens:
        {"input_ids": (T,) long, "loss_mask": (T,) long, "features": {key: (T, H)}}."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        j = bisect.bisect_right(self._starts, i) - 1
        f, offsets = self._shard(j)
        r = i - self._starts[j]
        a, b = int(offsets[r]), int(offsets[r + 1])
        if max_length is not None:
            b = min(b, a + max_length)
        return {"input_ids": f.get_slice("input_ids")[a:b].long(), "loss_mask": f.get_slice("loss_mask")[a:b].long(),
                "features": {k: f.get_slice(k)[a:b] for k in (self.keys if keys is None else keys)}}

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.row(i)
        return {**row.pop("features"), **row}

    def __repr__(self) -> str:
        return f"FeatureStore({str(self.path)!r}, rows={len(self)}, keys={self.keys}, dtype={self.manifest['dtype']})"


def features_cli(cfg: FeaturesConfig) -> int:
    features(cfg)
    return 0

