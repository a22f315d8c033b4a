"""Engine exports (design.md §4): native heads -> folders that vLLM, SGLang, TensorRT-LLM and the
speculators format load.

The converters live in ``export_layouts.py`` (engine facts and spec tables),
``export_speculators.py``, ``dflash_formats.py`` (DFlash, DSpark) and ``peagle_formats.py``; this module picks one per (kind, format), reads the heads, and writes
the folder beside ``out`` under a temporary name, renamed into place: an error leaves no
half-written export (and an existing one untouched).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file
from torch import nn

from ..config import read_json_object
from ..publish import check_output_path, check_replaceable, publishing
from .base import HeadsBase, check_finite, check_tokenizer, read_config, read_tensors, resolve_checkpoint
from .configs import ExportConfig  # noqa: F401  (re-exported)
from .export_layouts import (DTYPES, FORMATS, Export, ExportError, Spec, check_tensors,  # noqa: F401 (re-exported)
                             eagle1_sglang, eagle1_vllm, eagle3_sglang, eagle3_trtllm, eagle3_vllm, engine_aux_layers,
                             medusa_trtllm, medusa_vllm, native_spec)
from .dflash_formats import dflash_speculators, dflash_vllm
from .export_speculators import eagle3_speculators, why_not
from .peagle_formats import peagle_speculators, peagle_vllm

Exporter = Callable[[dict[str, Any], dict[str, torch.Tensor], "torch.Tensor | None", str], Export]
EXPORTERS: dict[tuple[str, str], Exporter] = {
    ("medusa", "vllm"): medusa_vllm, ("medusa", "trtllm"): medusa_trtllm,
    ("eagle1", "vllm"): eagle1_vllm, ("eagle1", "sglang"): eagle1_sglang,
    ("eagle3", "vllm"): eagle3_vllm, ("eagle3", "sglang"): eagle3_sglang, ("eagle3", "trtllm"): eagle3_trtllm,
    ("eagle3", "speculators"): eagle3_speculators,
    ("dflash", "vllm"): dflash_vllm, ("dflash", "speculators"): dflash_speculators,
    ("peagle", "vllm"): peagle_vllm, ("peagle", "speculators"): peagle_speculators,
}


# (kind, format) with no exporter -> why, when it is worth saying
REFUSALS: dict[tuple[str, str], str] = {(k, "speculators"): why_not(k) for k in ("eagle1", "medusa")}


# -- reading, converting, writing ---------------------------------------------------------------
def read_heads(source: str | Path | HeadsBase, revision: str | None = None
               ) -> tuple[dict[str, Any], dict[str, torch.Tensor], str]:
    """(config, tensors, where) from heads in memory, a checkpoint folder or a Hub repo id."""
    if isinstance(source, HeadsBase):
        return source.config_dict(), {k: v.detach().cpu() for k, v in source.state_dict().items()}, source.kind
    path = resolve_checkpoint(source, revision)
    cfg = read_config(path)
    weights = path / "model.safetensors"
    return cfg, read_tensors(weights, ExportError), str(weights)


def target_lm_head(target: nn.Module | str | Path | None, cfg: dict[str, Any]) -> torch.Tensor | None:
    """The target's output projection (V, H), after checking the target matches the heads."""
    if target is None:
        return None
    if not isinstance(target, nn.Module):
        from ..target import resolve_target_path
        from ..target import load_target

        target, tokenizer = load_target(resolve_target_path(str(target)), device="cpu")
        check_tokenizer(cfg.get("metadata") or {}, tokenizer, f"{cfg['kind']} heads")
    from ..target import TargetInfo

    if cfg.get("target"):
        TargetInfo(**cfg["target"]).check_matches(TargetInfo.of(target))
    return target.get_output_embeddings().weight.detach().cpu()


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
            for k, v in tensors.items()}


def build_export(source: str | Path | HeadsBase, fmt: str, target: nn.Module | str | Path | None = None,
                 dtype: str | None = None, revision: str | None = None) -> Export:
    """Everything but the writing: read, check the input, convert, check the output against the spec."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format '{fmt}'; use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"unknown dtype '{dtype}'; use one of {', '.join(DTYPES)}")
    cfg, tensors, where = read_heads(source, revision)
    kind = cfg["kind"]
    fn = EXPORTERS.get((kind, fmt))
    if fn is None and (kind, fmt) in REFUSALS:
        raise ExportError(REFUSALS[(kind, fmt)])
    if fn is None:
        engines = [f for k, f in EXPORTERS if k == kind]
        raise ExportError(f"{kind} heads cannot be exported to {fmt}; formats for {kind}: {', '.join(engines)}")
    check_tensors(tensors, native_spec(cfg), f"heads checkpoint {where}")
    check_finite(tensors, f"heads checkpoint {where}", ExportError)  # an engine would load NaN weights silently
    lm_head = target_lm_head(target, cfg) if kind == "medusa" and not cfg["own_lm_head"] else None
    out_dtype = dtype or str(next(v.dtype for v in tensors.values() if v.is_floating_point())).removeprefix("torch.")
    ex = fn(cfg, tensors, lm_head, out_dtype)
    ex.tensors = _cast(ex.tensors, DTYPES.get(out_dtype))
    check_tensors(ex.tensors, ex.spec, f"{fmt} export of {where}")
    return ex


def export_readme(ex: Export, fmt: str) -> str:
    h = ex.config["headway"]
    lines = [f"# {h['kind']} heads exported for {fmt}", "", f"Exported by {h['exported_by']} from a headway "
             f"checkpoint trained for `{(h.get('target') or {}).get('name_or_path')}`.", "", "## Load", ""]
    lines += [f"- {n}" for n in ex.notes]
    lines += ["", "## Files", "", "- `config.json`", f"- `{ex.weights_file}` ({len(ex.tensors)} tensors)", ""]
    return "\n".join(lines)


def write_atomic(out: Path, files: dict[str, Callable[[Path], None]]) -> Path:
    """Write each file through its writer into a temp folder beside ``out``, then rename into place."""
    with publishing(out, folder=True) as tmp:
        for name, write in files.items():
            write(tmp / name)
    return out


def export_provenance(folder: Path) -> dict[str, Any] | None:
    """The ``headway`` section of an export folder's config.json (what ``_provenance`` writes), or None
    when the folder holds no headway export."""
    f = folder / "config.json"
    try:
        cfg = read_json_object(f, ExportError) if f.is_file() else {}
    except ExportError:
        return None
    h = cfg.get("headway")
    exported = isinstance(h, dict) and "kind" not in cfg and str(h.get("exported_by", "")).startswith("headway")
    return h if exported else None


def check_export_out(out: str | Path, fmt: str, source: str | Path | HeadsBase) -> Path:
    """``out`` resolved, if an export may be written there: a new (or empty) folder, or one holding
    only an earlier headway export to ``fmt``, and never the heads themselves or a folder above them
    or inside them. Refuses before any work, with one line naming what is there."""
    inputs = [] if isinstance(source, HeadsBase) else [source]
    folder = check_output_path(out, "--out", inputs=inputs, below_inputs=False, replaced=True, error=ExportError)
    earlier = check_replaceable(folder, f"--out {out}", "headway export", lambda p: export_provenance(p) is not None,
                                lambda name: name in ("config.json", "README.md") or name.endswith(".safetensors"),
                                ExportError)
    if earlier and (was := export_provenance(folder).get("format")) != fmt:
        raise ExportError(f"--out {out} holds a {was} export, not a {fmt} one; choose a new folder")
    return folder


def export_heads(source: str | Path | HeadsBase, fmt: str, out: str | Path,
                 target: nn.Module | str | Path | None = None, dtype: str | None = None,
                 revision: str | None = None) -> Path:
    """Export heads (object, folder or Hub repo id) to ``out`` in an engine's format: a new folder, or
    one holding an earlier export to the same format, replaced atomically (``check_export_out``)."""
    folder = check_export_out(out, fmt, source)
    ex = build_export(source, fmt, target, dtype, revision)
    kind = ex.config["headway"]["kind"]
    meta = {"format": "pt", "exported_by": "headway", "kind": kind, "engine": fmt}
    files: dict[str, Callable[[Path], None]] = {
        ex.weights_file: lambda p: save_file(ex.tensors, str(p), metadata=meta),
        "config.json": lambda p: p.write_text(json.dumps(ex.config, indent=2) + "\n"),
        "README.md": lambda p: p.write_text(export_readme(ex, fmt)),
    }
    return write_atomic(folder, files)


# -- CLI ----------------------------------------------------------------------------------------
def export_cli(cfg: ExportConfig) -> int:
    import time

    t0 = time.perf_counter()
    out = export_heads(cfg.heads, cfg.format, cfg.out, target=cfg.target, dtype=cfg.dtype, revision=cfg.revision)
    print(f"exported {cfg.heads} for {cfg.format} into {cfg.out} ({time.perf_counter() - t0:.1f}s)")
    print((out / "README.md").read_text().split("## Load", 1)[1].split("## Files", 1)[0].strip())
    return 0
