"""P-EAGLE drafters in the engines' layouts: export (``headway export``) and import (``headway import``).

Facts from vLLM 0.32.0 (``models/llama_eagle3.py``, ``v1/spec_decode/llm_base_proposer.py``,
``transformers_utils/configs/speculators/{algos,base}.py``, ``transformers_utils/configs/eagle.py``) and
speculators (``models/peagle/``); docs/peagle.md has the details:

- vLLM runs P-EAGLE as EAGLE-3 with ``parallel_drafting``: ``Eagle3LlamaForCausalLM`` with
  ``num_hidden_layers`` layers (layer 0 the fused EAGLE-3 layer with 2H-wide q/k/v and ``hidden_norm``,
  layers 1.. plain Llama layers), and a ``mask_hidden`` tensor (3H values, any shape: loaded with
  ``view(1, -1)``) that it refuses to run without. The mask token id is read from the config as
  ``mask_token_id`` (then ``pard_token``, ``ptd_token_id``). ``embed_tokens.weight`` is optional: without
  it the target's embedding is shared. Tensors are loaded by name with no check that every parameter
  was given, so a misnamed tensor would leave a random weight: every name is held to a spec here.
- **speculators layout** (``--format speculators``; ``vllm serve THIS_FOLDER`` finds the target by itself):
  ``speculators_model_type: peagle``, ``transformer_layer_config`` (a Llama config: vLLM picks
  ``PeagleLlamaForCausalLM``), ``mask_token_id`` (vLLM writes it to ``pard_token``), ``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` (false when absent), ``norm_before_fc``,
  ``eagle_aux_hidden_state_layer_ids`` (HF indices), and ``speculative_tokens`` = K, which vLLM turns into
  ``method: eagle3, parallel_drafting: true``. speculators stores ``mask_hidden`` as (1, 1, 3H).
- **vLLM layout** (``--format vllm``): the EAGLE-3 export's Llama config (``LlamaForCausalLMEagle3``: vLLM's
  EAGLE config renames any other architecture to ``Eagle3<name>``, so ``PEagleDraftModel`` would not load)
  plus ``mask_token_id``; served with ``speculative_config={"method": "eagle3", "parallel_drafting": true}``.
  ``mask_hidden`` as (1, 3H), the shape vLLM's buffer has.
- vLLM counts the fused layers from ``eagle_config`` or assumes 3: P-EAGLE fuses exactly 3 here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .base import HeadsError
from .export_layouts import Export, ExportError, Spec, _layer_spec, _provenance, engine_aux_layers, llama_config
from .layers import LayerGeometry
from .peagle import PEagleConfig, PEagleDrafter

MASK_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")  # the order vLLM reads them in
DEFAULT_DEPTHS = 8  # K of a checkpoint that does not say (the paper's and speculators' training default)


# -- export -------------------------------------------------------------------------------------------
def peagle_spec(c: dict[str, Any], mask_shape: tuple[int, ...], own_embeddings: bool) -> Spec:
    """The tensors of either layout, from the Llama layer config written (``c``)."""
    H, Ht, V, Vd = c["hidden_size"], c["target_hidden_size"], c["vocab_size"], c["draft_vocab_size"]
    spec: Spec = {"fc.weight": ((H, 3 * Ht), None), "mask_hidden": (mask_shape, None), "norm.weight": ((H,), None),
                  "lm_head.weight": ((Vd, H), None), "d2t": ((Vd,), torch.int64), "t2d": ((V,), torch.bool),
                  "layers.0.input_layernorm.weight": ((H,), None), "layers.0.hidden_norm.weight": ((H,), None),
                  **_layer_spec(c, "layers.0.", 2 * H)}
    for i in range(1, c["num_hidden_layers"]):
        spec |= {f"layers.{i}.input_layernorm.weight": ((H,), None), **_layer_spec(c, f"layers.{i}.", H)}
    if c.get("norm_before_fc"):
        spec["input_norm.weight"] = ((3 * Ht,), None)
    if own_embeddings:
        spec["embed_tokens.weight"] = ((V, H), None)
    return spec


def _layer_config(cfg: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The drafter's layers as one Llama config, with the fields both layouts share."""
    target = cfg.get("target") or {}
    if not target.get("num_hidden_layers"):
        raise ExportError("the checkpoint records no target (num_hidden_layers); cannot check its P-EAGLE aux layers")
    layer = llama_config(cfg, "LlamaForCausalLMEagle3", dtype) | {"num_hidden_layers": cfg["num_layers"]}
    ids = engine_aux_layers(list(cfg["aux_layers"]), int(target["num_hidden_layers"]), "vllm")
    return layer | {"draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["hidden_size"],
                    "norm_before_residual": bool(cfg["norm_before_residual"]),
                    "norm_before_fc": bool(cfg["norm_before_fc"]), "eagle_aux_hidden_state_layer_ids": ids,
                    "mask_token_id": cfg["mask_token_id"]}


def _tensors(cfg: dict[str, Any], t: dict[str, torch.Tensor], mask_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {k: v.reshape(mask_shape) if k == "mask_hidden" else v for k, v in t.items()}


def _provenance_of(cfg: dict[str, Any], fmt: str, ids: list[int]) -> dict[str, Any]:
    return _provenance(cfg, fmt, aux_layers_hf_index=list(cfg["aux_layers"]), aux_layers_written=ids,
                       aux_layer_convention="HF output_hidden_states index", num_depths=cfg["num_depths"])


def peagle_vllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None, dtype: str) -> Export:
    """vLLM's own layout: an EAGLE-3 folder with ``mask_hidden`` and ``mask_token_id``."""
    config = _layer_config(cfg, dtype)
    ids = config["eagle_aux_hidden_state_layer_ids"]
    config |= {"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
               "headway": _provenance_of(cfg, "vllm", ids)}
    shape = (1, 3 * cfg["hidden_size"])
    k = cfg["num_depths"]
    notes = [f"vLLM: `LLM(model=TARGET, speculative_config={{\"method\": \"eagle3\", \"model\": THIS_FOLDER, "
             f"\"num_speculative_tokens\": {k}, \"parallel_drafting\": true}})` (trained to draft {k} tokens a step)"]
    return Export(config, _tensors(cfg, t, shape), peagle_spec(config, shape, cfg["own_embeddings"]), notes=notes)


def peagle_speculators(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                       dtype: str) -> Export:
    """speculators' layout: ``vllm serve THIS_FOLDER`` loads the verifier it names and drafts K in parallel."""
    from .export_speculators import _verifier, proposal

    verifier = _verifier(cfg)
    layer = _layer_config(cfg, dtype)
    top = {k: layer.pop(k) for k in ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                                     "norm_before_fc", "eagle_aux_hidden_state_layer_ids", "mask_token_id")}
    layer.pop("torch_dtype")
    layer["architectures"] = ["LlamaForCausalLM"]
    config = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
              "speculators_config": proposal("peagle", cfg["num_depths"], verifier),
              "transformer_layer_config": layer, **top, "fc_norm": False, "norm_output": False,
              "embed_requires_grad": bool(cfg["own_embeddings"]), "tie_word_embeddings": False, "torch_dtype": dtype,
              "headway": _provenance_of(cfg, "speculators", top["eagle_aux_hidden_state_layer_ids"])}
    shape = (1, 1, 3 * cfg["hidden_size"])
    notes = [f"vLLM: `vllm serve THIS_FOLDER` or `LLM(model=THIS_FOLDER)` — the verifier `{verifier['name_or_path']}` "
             f"named in config.json is loaded as the target; {cfg['num_depths']} tokens drafted in one pass "
             "(parallel drafting)"]
    return Export(config, _tensors(cfg, t, shape), peagle_spec(layer | top, shape, cfg["own_embeddings"]), notes=notes)


# -- import -------------------------------------------------------------------------------------------
def is_peagle_config(cfg: dict[str, Any]) -> bool:
    """speculators' ``peagle`` type, or an EAGLE-3 config naming a mask token (vLLM's own layout)."""
    return cfg.get("speculators_model_type") == "peagle" or (
        "speculators_model_type" not in cfg and "dflash_config" not in cfg and any(k in cfg for k in MASK_KEYS))


def _num_depths(cfg: dict[str, Any]) -> tuple[int, str]:
    """K, and where it was read: headway's export record, speculators' proposal, else the default."""
    if (cfg.get("headway") or {}).get("num_depths"):
        return int(cfg["headway"]["num_depths"]), "headway export"
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or []
    if methods and methods[0].get("speculative_tokens"):
        return int(methods[0]["speculative_tokens"]), "speculators proposal"
    return DEFAULT_DEPTHS, f"not recorded: assumed {DEFAULT_DEPTHS} (the P-EAGLE default)"


def _num_layers(tensors: dict[str, torch.Tensor]) -> int:
    found = {int(k.split(".")[1]) for k in tensors if k.startswith("layers.")}
    if found != set(range(len(found))) or not found:
        raise HeadsError(f"P-EAGLE layers should be numbered 0..n-1, found {sorted(found)}")
    return len(found)


def import_peagle(name_or_path: str | Path, target: nn.Module | None = None, revision: str | None = None
                  ) -> PEagleDrafter:
    """A folder (or Hub id) in either layout -> a native drafter; with ``target`` it is checked (hidden
    and vocabulary sizes, naming both values) and attached."""
    from .eagle_import import (check_draft_vocab, check_shapes, exported_aux_layers, geometry, layer_config,
                               read_weights, resolve_reference, speculators_options, t2d_from_d2t)

    path = resolve_reference(name_or_path, revision)
    if not (path / "config.json").is_file():
        raise HeadsError(f"{path} has no config.json")
    cfg = json.loads((path / "config.json").read_text())
    if not is_peagle_config(cfg):
        raise HeadsError(f"{path}/config.json is not a P-EAGLE config (no speculators_model_type: peagle, no mask "
                         f"token among {', '.join(MASK_KEYS)})")
    tensors = {k.removeprefix("model."): v for k, v in read_weights(path).items()}
    mask = next((cfg[k] for k in MASK_KEYS if cfg.get(k) is not None), None)
    if mask is None or "mask_hidden" not in tensors:
        raise HeadsError(f"{path}: a P-EAGLE drafter needs a mask token id ({' / '.join(MASK_KEYS)}) and a "
                         "'mask_hidden' tensor; this one lacks " + ("the id" if mask is None else "mask_hidden"))
    lc, inner = layer_config(cfg)
    g: LayerGeometry = geometry(cfg, tensors, "layers.0.")
    ids = exported_aux_layers(cfg) or [int(i) for i in (cfg.get("eagle_aux_hidden_state_layer_ids")
                                                         or (cfg.get("eagle_config") or {}).get(
                                                             "eagle_aux_hidden_state_layer_ids") or [])]
    vocab = int(cfg.get("target_vocab_size") or inner.get("target_vocab_size") or lc.vocab_size)
    Vd = int(tensors["lm_head.weight"].shape[0]) if "lm_head.weight" in tensors else vocab
    if "d2t" not in tensors and Vd == vocab:
        tensors["d2t"] = torch.zeros(Vd, dtype=torch.long)  # a full draft vocabulary: the identity
    if "t2d" not in tensors and "d2t" in tensors:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], vocab)
    tensors["mask_hidden"] = tensors["mask_hidden"].reshape(-1)
    opts = speculators_options(cfg, tensors)
    K, k_from = _num_depths(cfg)
    try:
        config = PEagleConfig(hidden_size=g.hidden_size, vocab_size=vocab, draft_vocab_size=Vd, aux_layers=ids,
                              num_depths=K, num_layers=_num_layers(tensors), mask_token_id=int(mask),
                              norm_before_fc=opts["norm_before_fc"], norm_before_residual=opts["norm_before_residual"],
                              own_embeddings="embed_tokens.weight" in tensors, layer=g)
    except ValueError as e:
        raise HeadsError(f"{path}: {e}") from None
    drafter = PEagleDrafter(config)
    check_shapes(drafter, tensors, {}, str(path))
    check_draft_vocab(tensors["d2t"], tensors["t2d"], str(path))
    drafter.load_state_dict({k: v.long() if k == "d2t" else v.bool() if k == "t2d" else v.float()
                             for k, v in tensors.items()}, strict=True)
    drafter.metadata["imported"] = {"source": str(name_or_path), "num_depths_from": k_from,
                                    "layout": "speculators-peagle" if cfg.get("speculators_model_type") else "vllm-peagle"}
    if target is not None:
        drafter.attach(target)
        drafter.to(device=target.get_output_embeddings().weight.device)
    return drafter.eval()
