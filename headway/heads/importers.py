"""Import reference checkpoints as native heads, so their users can switch (design.md §4).

``IMPORTERS`` maps a reference format to its reader; ``import_heads`` picks one by looking
at the files (``kind="auto"``) and ``headway import`` is its command line.

**FasterDecoding Medusa** (``medusa_lm_head.safetensors`` or ``medusa_lm_head.pt``; the
``.pt`` is read with ``torch.load(weights_only=True)``, never unpickled): an
``nn.ModuleList`` of heads, each ``Sequential(*[ResBlock] * n, Linear(H, V, bias=False))``,
so the tensors are ``{h}.{l}.linear.weight/bias`` for ResBlock l and ``{h}.{n}.weight`` for
the vocab projection, possibly prefixed ``medusa_head.``. Head and layer counts are read
from the tensor names, never from the config (the reference's config has been wrong).

**vLLM Medusa** (what ``headway export --format vllm`` writes for Medusa heads): a folder with
``config.json`` (``model_type: medusa``, ``truncated_vocab_size``) and ``model.safetensors`` with
``blocks.{h}.layers.{l}.weight/bias``, ``lm_heads.{h}.weight`` and, for a reduced vocabulary,
``token_map`` (draft id i -> target id). Counts are again read from the tensor names.

**DFlash** (the published layout and the speculators ``dflash`` / ``dspark`` ones):
``dflash_formats.import_dflash``. **P-EAGLE** (vLLM's layout and speculators' ``peagle``):
``peagle_formats.import_peagle``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..config import check_choice, read_json_object
from ..errors import HeadwayError
from ..publish import check_output_path, check_replaceable
from ..target import TargetInfo
from .base import HeadsBase, HeadsError, load_state_strict
from .files import is_heads_checkpoint, read_config
from .files import read_reference_tensors as read_tensors
from .configs import ImportConfig  # noqa: F401  (re-exported; light, for --help)
from .medusa import MedusaConfig, MedusaHeads

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
_RES = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_PROJ = re.compile(r"^(\d+)\.(\d+)\.weight$")


def _medusa_file(path_or_file: str | Path) -> Path:
    from ..target import resolve_folder

    p = Path(path_or_file).expanduser()
    if p.is_file():
        return p
    folder = resolve_folder(path_or_file, allow_patterns=["medusa_lm_head.*", "*.json"], what="Medusa checkpoint",
                            error=HeadsError)
    for name in MEDUSA_FILES:
        if (folder / name).is_file():
            return folder / name
    raise HeadsError(f"{folder} has no {' or '.join(MEDUSA_FILES)}; is it a FasterDecoding Medusa checkpoint?")


def medusa_layout(tensors: dict[str, torch.Tensor], where: str) -> tuple[int, int, bool]:
    """(num_heads, num_layers, bias) from FasterDecoding tensor names (``medusa_head.`` already stripped)."""
    res: dict[int, set[int]] = {}
    proj: dict[int, int] = {}
    has_bias = False
    for k in tensors:
        if m := _RES.match(k):
            res.setdefault(int(m[1]), set()).add(int(m[2]))
            has_bias |= m[3] == "bias"
        elif m := _PROJ.match(k):
            proj[int(m[1])] = int(m[2])
        else:
            raise HeadsError(f"{where}: unexpected tensor '{k}' for a FasterDecoding Medusa checkpoint")
    heads = sorted(proj)
    if not heads or heads != list(range(len(heads))):
        raise HeadsError(f"{where}: head vocab projections '{{h}}.{{n}}.weight' should be numbered 0..K-1, got {heads}")
    layers = {proj[h] for h in heads}
    if len(layers) != 1:
        raise HeadsError(f"{where}: heads have different depths {sorted(layers)}")
    n = layers.pop()
    for h in heads:
        if res.get(h, set()) != set(range(n)):
            raise HeadsError(f"{where}: head {h} should have ResBlocks 0..{n - 1}, found {sorted(res.get(h, set()))}")
    if set(res) - set(heads):
        raise HeadsError(f"{where}: ResBlocks for heads {sorted(set(res) - set(heads))} without a vocab projection")
    return len(heads), n, has_bias


def import_medusa(path_or_file: str | Path, target: nn.Module | None = None) -> MedusaHeads:
    """FasterDecoding ``medusa_lm_head.{safetensors,pt}`` (a file, its folder, or a Hub id) -> ``MedusaHeads``.

    With ``target`` the sizes are checked (a mismatch names both values) and the heads attached."""
    f = _medusa_file(path_or_file)
    tensors = {k.removeprefix("medusa_head."): v for k, v in read_tensors(f).items()}
    K, n, bias = medusa_layout(tensors, str(f))
    V, H = tensors[f"0.{n}.weight"].shape
    info = _checked_target(target, H, V, str(f))
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=K, num_layers=n, own_lm_head=True,
                                     bias=bias), info)
    native = {}
    for k, v in tensors.items():
        if m := _RES.match(k):
            native[f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"] = v
        else:
            native[f"lm_heads.{_PROJ.match(k)[1]}.weight"] = v
    load_state_strict(heads, {k: v.float() for k, v in native.items()}, str(f))
    heads.metadata["imported"] = {"source": str(path_or_file), "format": "fasterdecoding-medusa", "file": f.name}
    return _attached(heads, target)


_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_LM = re.compile(r"^lm_heads\.(\d+)\.weight$")


def is_vllm_medusa(path: str | Path) -> bool:
    """A folder whose config.json says ``model_type: medusa`` (vLLM's Medusa layout)."""
    f = Path(path).expanduser() / "config.json"
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("model_type") == "medusa"
    except (OSError, ValueError, AttributeError):
        return False


def vllm_medusa_as_faster_decoding(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM Medusa names -> FasterDecoding names, so one layout check serves both formats."""
    n = 1 + max((int(m[2]) for k in tensors if (m := _VLLM_BLOCK.match(k))), default=-1)
    out = {}
    for k, v in tensors.items():
        if m := _VLLM_BLOCK.match(k):
            out[f"{m[1]}.{m[2]}.linear.{m[3]}"] = v
        elif m := _VLLM_LM.match(k):
            out[f"{m[1]}.{n}.weight"] = v
        elif k != "token_map":
            raise HeadsError(f"unexpected tensor '{k}' for a vLLM Medusa checkpoint")
    return out


def import_vllm_medusa(path: str | Path, target: nn.Module | None = None) -> MedusaHeads:
    """A vLLM Medusa folder (config.json + model.safetensors) -> ``MedusaHeads``; a ``token_map``
    (truncated vocabulary) becomes the heads' draft vocabulary."""
    folder = Path(path).expanduser()
    cfg = read_json_object(folder / "config.json", HeadsError)
    raw = read_tensors(folder / "model.safetensors")
    tensors = vllm_medusa_as_faster_decoding(raw)
    K, n, bias = medusa_layout(tensors, str(folder))
    N, H = tensors[f"0.{n}.weight"].shape
    V = int(cfg.get("vocab_size") or N)
    token_map = raw.get("token_map")
    if (token_map is None) != (N == V):
        raise HeadsError(f"{folder}: lm_heads have {N} rows for vocab_size {V} but token_map is "
                         f"{'missing' if token_map is None else 'present'}")
    info = _checked_target(target, H, V, str(folder))
    heads = MedusaHeads(MedusaConfig(hidden_size=H, vocab_size=V, num_heads=K, num_layers=n, own_lm_head=True,
                                     bias=bias, draft_vocab_size=None if token_map is None else N), info)
    native = {f"blocks.{m[1]}.layers.{m[2]}.{m[3]}": v.float() for k, v in tensors.items() if (m := _RES.match(k))}
    native |= {f"lm_heads.{h}.weight": tensors[f"{h}.{n}.weight"].float() for h in range(K)}
    if token_map is not None:
        heads.set_draft_vocab(token_map.long())
        native |= {"d2t": heads.d2t.clone(), "t2d": heads.t2d.clone()}
    load_state_strict(heads, native, str(folder))
    heads.metadata["imported"] = {"source": str(path), "format": "vllm-medusa"}
    return _attached(heads, target)


def _checked_target(target: nn.Module | None, H: int, V: int, where: str) -> TargetInfo | None:
    info = TargetInfo.of(target) if target is not None else None
    if info is not None:
        for name, mine, theirs in (("hidden_size", H, info.hidden_size), ("vocab_size", V, info.vocab_size)):
            if mine != theirs:
                raise HeadsError(f"{where} holds Medusa heads for a target with {name}={mine}, but this target has "
                                 f"{name}={theirs} ({info.name_or_path or 'model in hand'})")
    return info


def _attached(heads: MedusaHeads, target: nn.Module | None) -> MedusaHeads:
    if target is not None:
        heads.attach(target)
        heads.to(device=target.get_output_embeddings().weight.device)
    return heads.eval()


def _import_medusa_any(path: str | Path, target: nn.Module | None = None) -> MedusaHeads:
    return import_vllm_medusa(path, target) if is_vllm_medusa(path) else import_medusa(path, target)


def _import_eagle(path: str | Path, target: nn.Module | None = None) -> HeadsBase:
    from .eagle_import import import_eagle

    return import_eagle(path, target=target)


def _import_dflash(path: str | Path, target: nn.Module | None = None) -> HeadsBase:
    from .dflash_formats import import_dflash

    return import_dflash(path, target=target)


def _import_peagle(path: str | Path, target: nn.Module | None = None) -> HeadsBase:
    from .peagle_formats import import_peagle

    return import_peagle(path, target=target)


IMPORTERS: dict[str, Callable[..., HeadsBase]] = {"medusa": _import_medusa_any, "eagle": _import_eagle,
                                                  "dflash": _import_dflash, "peagle": _import_peagle}


def detect_format(path: str | Path) -> str:
    """'medusa' for FasterDecoding or vLLM Medusa files, 'dflash' for a DFlash or DSpark config (any
    layout), 'peagle' for a P-EAGLE config (either layout), else 'eagle' (EAGLE-1 / EAGLE-3 layouts)."""
    from .dflash_formats import is_dflash_config
    from .peagle_formats import is_peagle_config

    p = Path(path).expanduser()
    if p.is_file():
        return "medusa" if p.name.startswith("medusa_lm_head") or p.suffix == ".pt" else "eagle"
    if p.is_dir() and (any((p / n).is_file() for n in MEDUSA_FILES) or is_vllm_medusa(p)):
        return "medusa"
    try:
        cfg = json.loads((p / "config.json").read_text()) if p.is_dir() else {}
    except (OSError, ValueError):
        cfg = {}
    if isinstance(cfg, dict) and is_dflash_config(cfg):
        return "dflash"
    if isinstance(cfg, dict) and is_peagle_config(cfg):
        return "peagle"
    return "eagle"


def import_heads(path: str | Path, target: nn.Module | None = None, fmt: str = "auto") -> HeadsBase:
    """A reference checkpoint (``fmt``, or detected from its files) as native heads. Every fault of
    the checkpoint is one ``HeadsError`` line: a config whose values have the wrong type or
    shape, which the readers do not each check, is named as such."""
    fmt = detect_format(path) if fmt == "auto" else fmt
    check_choice(fmt, tuple(IMPORTERS), "format")
    try:
        return IMPORTERS[fmt](path, target=target)
    except HeadwayError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        why = (str(e).strip().splitlines() or [""])[0]
        raise HeadsError(f"{path}: not a readable {fmt} checkpoint ({type(e).__name__}: {why}); is its config.json "
                         "intact?") from None


CHECKPOINT_FILES = ("config.json", "model.safetensors", "README.md")  # what save_pretrained writes


def check_import_out(out: str | Path, source: str | Path) -> Path:
    """``out`` resolved, if imported heads may be saved there: a new (or empty) folder, or one holding
    only an earlier heads checkpoint, and never the source itself or a folder above or inside it.
    Refuses before any work, with one line naming what is there."""
    folder = check_output_path(out, "--out", inputs=[source], below_inputs=False, replaced=True, error=HeadsError)
    check_replaceable(folder, f"--out {out}", "headway heads checkpoint", is_heads_checkpoint,
                      lambda name: name in CHECKPOINT_FILES, HeadsError)
    return folder


def import_checkpoint(source: str | Path, out: str | Path, target: nn.Module | None = None,
                      fmt: str = "auto") -> HeadsBase:
    """``import_heads`` saved as a native checkpoint in ``out``: a new folder, or one holding an
    earlier checkpoint of the same kind, replaced atomically (``check_import_out``)."""
    folder = check_import_out(out, source)
    heads = import_heads(source, target=target, fmt=fmt)
    if is_heads_checkpoint(folder) and (was := read_config(folder)["kind"]) != heads.kind:
        raise HeadsError(f"--out {out} holds {was} heads, not {heads.kind} ones; choose a new folder")
    heads.save_pretrained(folder)
    return heads


def import_cli(cfg: ImportConfig) -> int:
    check_import_out(cfg.out, cfg.source)  # before the target loads
    target: Any = None
    if cfg.target:
        from ..target import resolve_target_path
        from ..target import load_target

        target, _ = load_target(resolve_target_path(cfg.target), device="cpu")
    heads = import_checkpoint(cfg.source, cfg.out, target=target, fmt=cfg.format)
    print(f"imported {heads.kind} heads from {cfg.source} into {cfg.out}")
    return 0
