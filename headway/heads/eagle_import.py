"""Import reference EAGLE-1 / EAGLE-3 checkpoints into native drafters (design.md §4).

Layouts read (weights: ``model.safetensors`` or ``pytorch_model.bin``, sharded or not; a
``.bin`` is read with ``torch.load(weights_only=True)``, never unpickled):

- **EAGLE-1** (SafeAILab EAGLE repo, vLLM/SGLang EAGLE-1): ``fc.weight [H, 2H]`` (+ optional
  ``fc.bias``), ``layers.0.self_attn.*``, ``layers.0.mlp.*``, ``layers.0.post_attention_layernorm``;
  no input norm. ``embed_tokens.weight`` (a copy of the target's) is dropped.
- **EAGLE-3, SGLang / SpecForge / EAGLE repo**: ``midlayer.*``, ``fc.weight [H, 3H]``,
  ``norm.weight``, ``lm_head.weight [Vd, H]``, ``d2t`` (offsets), ``t2d`` (bool). Aux layer
  ids in the config follow SGLang's convention (output of layer k = HF hidden-state index k+1).
- **EAGLE-3, vLLM / modelopt / speculators**: the same tensors named ``layers.0.*``; aux layer
  ids are HF hidden-state indices (vLLM reads them so), except in ModelOpt's export
  (``LlamaForCausalLMEagle3`` with ids under ``eagle_config``: the output of layer k, index - 1).
  ``t2d`` may be absent (derived from d2t). speculators' options are kept: ``norm_before_fc``
  (``input_norm.weight [3H]``), ``norm_before_residual``, ``norm_output`` (its trainer's defaults).

The config is a Llama config of the drafter layer (``hidden_size``, heads, ``rope_theta`` /
``rope_scaling`` ...). The drafter keeps the reference's own rotary settings, since those are
what it was trained with. Without aux layer ids the EAGLE-3 default (2, L//2, L-3) of the
target is used, so a target (or ``aux_layers``) must then be given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig

from ..config import read_json_object
from .base import HeadsBase, HeadsError
from .eagle import Eagle1Config, Eagle1Drafter, Eagle3Config, Eagle3Drafter, default_aux_layers
from .files import read_reference_tensors, read_tensors
from .layers import LayerGeometry

DROPPED = ("embed_tokens.weight",)
AUX_CONVENTIONS = ("sglang", "hf")


def resolve_reference(name_or_path: str | Path, revision: str | None = None) -> Path:
    """A local folder, or a Hub repo id fetched through huggingface_hub (its cache works offline)."""
    from ..target import resolve_folder

    return resolve_folder(name_or_path, revision, allow_patterns=["*.json", "*.safetensors", "*.bin"],
                          what="EAGLE checkpoint", error=HeadsError)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a reference folder: safetensors preferred, .bin read weights-only; shards joined."""
    for index, loader in (("model.safetensors.index.json", _load_st), ("pytorch_model.bin.index.json", _load_bin)):
        if (path / index).is_file():
            weight_map = read_json_object(path / index, HeadsError).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HeadsError(f"{path / index} has no 'weight_map' object")
            files = sorted(set(map(str, weight_map.values())))
            out: dict[str, torch.Tensor] = {}
            for f in files:
                out.update(loader(path / f))
            return out
    if (path / "model.safetensors").is_file():
        return _load_st(path / "model.safetensors")
    if (path / "pytorch_model.bin").is_file():
        return _load_bin(path / "pytorch_model.bin")
    raise HeadsError(f"{path} has no model.safetensors or pytorch_model.bin")


def _load_st(f: Path) -> dict[str, torch.Tensor]:
    return read_tensors(f)  # one line for a missing, empty or truncated file


def _load_bin(f: Path) -> dict[str, torch.Tensor]:
    return read_reference_tensors(f)  # weights-only reader shared with the Medusa importer


def detect_layout(tensors: dict[str, torch.Tensor]) -> str:
    """'eagle1', 'eagle3-sglang' (midlayer.*) or 'eagle3-vllm' (layers.0.* with fused input)."""
    if any(k.startswith("midlayer.") for k in tensors):
        return "eagle3-sglang"
    if "fc.weight" not in tensors or not any(k.startswith("layers.0.") for k in tensors):
        raise HeadsError("not an EAGLE checkpoint: expected 'fc.weight' and 'midlayer.*' or 'layers.0.*' tensors; "
                         f"found {sorted(tensors)[:8]}")
    if "layers.0.hidden_norm.weight" in tensors or "d2t" in tensors or "lm_head.weight" in tensors:
        return "eagle3-vllm"
    return "eagle1"


def layer_config(cfg: dict[str, Any]) -> tuple[LlamaConfig, dict[str, Any]]:
    """The drafter layer's Llama config (speculators nest it under transformer_layer_config)."""
    inner = dict(cfg.get("transformer_layer_config") or cfg)
    for k in ("architectures", "auto_map", "model_type"):
        inner.pop(k, None)
    return hf_config(LlamaConfig, inner), inner


def hf_config(config_class: type, fields: dict[str, Any]) -> Any:
    """``config_class.from_dict(fields)``; a field of the wrong type is one ``HeadsError`` line."""
    try:
        return config_class.from_dict(fields)
    except Exception as e:  # transformers validates fields with huggingface_hub's errors, which are no ValueError
        raise HeadsError(f"the drafter layer's config is invalid: {' '.join(str(e).split())}") from None


def geometry(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str) -> LayerGeometry:
    lc, inner = layer_config(cfg)
    g = LayerGeometry.from_target(lc)
    g.attention_bias = f"{prefix}self_attn.q_proj.bias" in tensors
    target_h = cfg.get("target_hidden_size") or inner.get("target_hidden_size")
    if target_h is not None and int(target_h) != g.hidden_size:
        raise HeadsError(f"this drafter has hidden_size={g.hidden_size} but target_hidden_size={target_h}; "
                         "headway drafters share the target's hidden size")
    if cfg.get("fc_norm") or inner.get("fc_norm"):
        raise HeadsError("fc_norm=true (one RMSNorm per target layer before fc) is not supported; "
                         "norm_before_fc (one norm over the three) is")
    return g


def speculators_options(cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, bool]:
    """speculators' EAGLE-3 options (``norm_before_fc``, ``norm_before_residual``, ``norm_output``) from the
    config; ``input_norm.weight`` present means norm_before_fc whatever the config says."""
    inner = cfg.get("transformer_layer_config") or {}
    opts = {k: bool(cfg.get(k, inner.get(k, False))) for k in ("norm_before_fc", "norm_before_residual", "norm_output")}
    opts["norm_before_fc"] |= "input_norm.weight" in tensors
    return opts


def aux_ids_from_config(cfg: dict[str, Any]) -> list[int] | None:
    for where in (cfg, cfg.get("eagle_config") or {}, cfg.get("speculators_config") or {}):
        ids = where.get("eagle_aux_hidden_state_layer_ids")
        if ids:
            return [int(i) for i in ids]
    return None


def default_convention(cfg: dict[str, Any], layout: str) -> str:
    """How config aux ids are numbered when the caller does not say: a top-level
    ``eagle_aux_hidden_state_layer_ids`` or a speculators config is read by vLLM, which takes HF
    hidden-state indices; ids nested in ``eagle_config`` (ModelOpt's ``LlamaForCausalLMEagle3``
    export) and ``midlayer.*`` checkpoints name the output of layer k (SGLang: index - 1)."""
    if cfg.get("eagle_aux_hidden_state_layer_ids") or cfg.get("speculators_model_type"):
        return "hf"
    if (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        return "sglang"  # ModelOpt's export: its ids name the layer whose output it hooked (HF index - 1)
    return "sglang" if layout == "eagle3-sglang" else "hf"


def exported_aux_layers(cfg: dict[str, Any]) -> list[int] | None:
    """HF indices recorded by ``headway export`` (its ``headway`` block), whatever the engine numbering."""
    ids = (cfg.get("headway") or {}).get("aux_layers_hf_index")
    return [int(i) for i in ids] if ids else None


def resolve_aux_layers(cfg: dict[str, Any], convention: str, target: nn.Module | None,
                       aux_layers: list[int] | None) -> list[int]:
    """HF hidden-state indices of the fused layers: explicit, from the config, or the default."""
    if aux_layers is not None:
        return list(aux_layers)
    if convention not in AUX_CONVENTIONS:
        raise HeadsError(f"aux layer convention must be one of {AUX_CONVENTIONS}; got '{convention}'")
    ids = aux_ids_from_config(cfg)
    if ids is not None:
        return [i + 1 for i in ids] if convention == "sglang" else ids
    if target is None:
        raise HeadsError("the checkpoint names no eagle_aux_hidden_state_layer_ids; pass the target (for its "
                         "default (2, L//2, L-3)) or aux_layers explicitly")
    return default_aux_layers(int(target.config.num_hidden_layers))


def check_shapes(module: nn.Module, tensors: dict[str, torch.Tensor], renamed: dict[str, str], where: str) -> None:
    """Refuse missing / unexpected / mis-shaped tensors, naming the reference tensor and both shapes."""
    own = module.state_dict()
    missing = sorted(k for k in own if k not in tensors)
    unexpected = sorted(renamed.get(k, k) for k in tensors if k not in own)
    if missing or unexpected:
        raise HeadsError(f"{where}: tensors do not match an EAGLE drafter; missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    for k, v in sorted(tensors.items()):
        if own[k].shape != v.shape:
            raise HeadsError(f"{where}: tensor '{renamed.get(k, k)}' has shape {tuple(v.shape)}, but the drafter "
                             f"described by config.json needs {tuple(own[k].shape)}")


def import_eagle(name_or_path: str | Path, target: nn.Module | None = None, aux_layers: list[int] | None = None,
                 aux_convention: str | None = None, revision: str | None = None) -> HeadsBase:
    """Read a reference EAGLE-1 / EAGLE-3 checkpoint (any layout above) as a native drafter.

    ``target`` (optional) is checked (hidden and vocab sizes, naming both values) and attached.
    ``aux_convention`` overrides how config aux ids are read: 'sglang' (id k = HF index k+1, the
    default for ``midlayer.*``) or 'hf' (the default for ``layers.0.*``)."""
    path = resolve_reference(name_or_path, revision)
    if not (path / "config.json").is_file():
        raise HeadsError(f"{path} has no config.json")
    cfg = read_json_object(path / "config.json", HeadsError)
    tensors = {k.removeprefix("model."): v for k, v in read_weights(path).items()}
    tensors = {k: v for k, v in tensors.items() if k not in DROPPED}
    layout = detect_layout(tensors)
    if layout == "eagle1":
        drafter = _build_eagle1(cfg, tensors, path)
    else:
        conv = aux_convention or default_convention(cfg, layout)
        if aux_layers is None and aux_convention is None:
            aux_layers = exported_aux_layers(cfg)
        drafter = _build_eagle3(cfg, tensors, layout, resolve_aux_layers(cfg, conv, target, aux_layers), path)
        drafter.metadata["imported"] = {"aux_convention": conv}
    drafter.metadata.setdefault("imported", {}).update(source=str(name_or_path), layout=layout)
    if target is not None:
        drafter.attach(target)
        drafter.to(device=target.get_output_embeddings().weight.device)
    return drafter.eval()


def _build_eagle1(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], path: Path) -> Eagle1Drafter:
    if cfg.get("headway") and "fc.bias" in tensors and not tensors["fc.bias"].any():
        del tensors["fc.bias"]  # headway's SGLang export writes zeros for "no bias" (SGLang's fc has one)
    g = geometry(cfg, tensors, "layers.0.")
    vocab = int(layer_config(cfg)[0].vocab_size)
    drafter = Eagle1Drafter(Eagle1Config(hidden_size=g.hidden_size, vocab_size=vocab, layer=g,
                                         fc_bias="fc.bias" in tensors))
    check_shapes(drafter, tensors, {}, str(path))
    drafter.load_state_dict(tensors, strict=True)
    return drafter


def _build_eagle3(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], layout: str, aux: list[int],
                  path: Path) -> Eagle3Drafter:
    renamed: dict[str, str] = {}
    if layout == "eagle3-vllm":
        native = {}
        for k, v in tensors.items():
            n = "midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k
            native[n], renamed[n] = v, k
        tensors = native
    g = geometry(cfg, tensors, "midlayer.")
    lc, inner = layer_config(cfg)
    vocab = int(cfg.get("target_vocab_size") or inner.get("target_vocab_size") or lc.vocab_size)
    draft_vocab = int(cfg.get("draft_vocab_size") or inner.get("draft_vocab_size")
                      or tensors.get("lm_head.weight", torch.empty(vocab, 0)).shape[0])
    if "t2d" not in tensors and "d2t" in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], vocab)
    drafter = Eagle3Drafter(Eagle3Config(hidden_size=g.hidden_size, vocab_size=vocab, draft_vocab_size=draft_vocab,
                                         aux_layers=aux, layer=g, **speculators_options(cfg, tensors)))
    check_shapes(drafter, tensors, renamed, str(path))
    check_draft_vocab(tensors["d2t"], tensors["t2d"], str(path))
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    drafter.load_state_dict(tensors, strict=True)
    return drafter


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(Vd,) offsets -> (V,) bool mask of target ids in the draft vocabulary."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise HeadsError(f"d2t maps draft ids outside the target vocabulary 0..{vocab_size - 1}")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return t2d


def check_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """d2t and t2d must describe the same set of distinct target ids."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    if ids.unique().numel() != ids.numel():
        raise HeadsError(f"{where}: d2t maps two draft ids to the same target id")
    if ids.min() < 0 or ids.max() >= t2d.numel() or not t2d.bool()[ids].all() or int(t2d.bool().sum()) != ids.numel():
        raise HeadsError(f"{where}: d2t and t2d disagree about the draft vocabulary")
