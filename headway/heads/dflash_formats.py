"""DFlash drafters in the engines' layouts: export (``headway export``) and import (``headway import``).

Two layouts carry the same tensors (``fc``, ``hidden_norm``, ``layers.{i}.*`` with Qwen3-style
``self_attn.q_norm`` / ``k_norm``, ``norm``; ``lm_head`` / ``d2t`` / ``t2d`` only with a reduced
draft vocabulary, else the engine shares the target's lm_head and embeddings). Facts from the
reference implementation (z-lab ``dflash/model.py``) and vLLM (``models/qwen3_dflash.py``,
``transformers_utils/configs/speculators/algos.py: update_dflash``):

- **Reference layout** (``--format vllm``; what the published DFlash drafters ship, read by vLLM's
  ``DFlashDraftModel`` and SGLang's ``--speculative-algorithm DFLASH``): a Qwen3 config of the draft
  layers (``num_hidden_layers`` = draft layers) plus ``block_size``, ``num_target_layers`` and
  ``dflash_config`` {``mask_token_id``, ``target_layer_ids``}. Target layer id k is the *output* of
  decoder layer k: HF hidden-state index k + 1 (headway's numbering minus one).
- **speculators layout** (``--format speculators``; vLLM detects it by itself): ``speculators_model_type:
  dflash``, ``transformer_layer_config`` (the same Qwen3 config), ``aux_hidden_state_layer_ids`` in HF
  indices (vLLM captures the stream entering layer k and writes ``target_layer_ids`` = k - 1),
  ``mask_token_id``, ``block_size``, ``draft_vocab_size``, ``target_hidden_size`` and the verifier.
- vLLM's DFlash layer always has q/k norms and captures aux states before the final norm, so a
  drafter without q/k norms, or one reading HF index 0 (the embeddings) or L (post-norm in
  transformers v5), is refused.
- **DSpark** (a drafter with ``markov_rank`` or ``confidence_head``): speculators' ``dspark`` type, read by
  vLLM's ``update_dspark`` into ``Qwen3DSparkModel`` (``models/qwen3_dspark.py``): the DFlash tensors plus
  ``markov_head.markov_w1.weight (V, r)``, ``markov_head.markov_w2.weight (Vd, r)`` and, with
  ``enable_confidence_head``, ``confidence_head.proj.weight (1, H [+ r])`` and ``.bias (1,)``; config keys
  ``markov_rank``, ``markov_head_type: vanilla`` (the only head vLLM builds), ``enable_confidence_head``,
  ``confidence_head_with_markov`` and ``sample_from_anchor: false`` (headway's block: the anchor is the
  bonus token and slot k predicts anchor + k, vLLM's "fill-in" layout; vLLM defaults to false when the key
  is absent, speculators' trainer to true). vLLM always builds the Markov head, so a confidence head
  without one is refused; vLLM serves DSpark on its GPU model runner (V2) only, and has no other layout
  for it, so ``--format vllm`` refuses DSpark drafters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import read_json_object
from .base import HeadsError
from .dflash import DFlashConfig, DFlashDrafter
from .export_layouts import Export, ExportError, Spec, _provenance
from .layers import LayerGeometry

SPECULATORS_ARCH = "DFlashDraftModel"


# -- export -------------------------------------------------------------------------------------------
def dflash_spec(c: dict[str, Any]) -> Spec:
    """The tensors of either layout, from the Qwen3 layer config written (``c``) and the drafter's."""
    H, I, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv, hd = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], c["head_dim"]
    spec: Spec = {"fc.weight": ((H, c["num_aux_layers"] * c["target_hidden_size"]), None),
                  "hidden_norm.weight": ((H,), None), "norm.weight": ((H,), None)}
    for i in range(n):
        p = f"layers.{i}."
        spec |= {f"{p}self_attn.q_proj.weight": ((q, H), None), f"{p}self_attn.k_proj.weight": ((kv, H), None),
                 f"{p}self_attn.v_proj.weight": ((kv, H), None), f"{p}self_attn.o_proj.weight": ((H, q), None),
                 f"{p}self_attn.q_norm.weight": ((hd,), None), f"{p}self_attn.k_norm.weight": ((hd,), None),
                 f"{p}mlp.gate_proj.weight": ((I, H), None), f"{p}mlp.up_proj.weight": ((I, H), None),
                 f"{p}mlp.down_proj.weight": ((H, I), None), f"{p}input_layernorm.weight": ((H,), None),
                 f"{p}post_attention_layernorm.weight": ((H,), None)}
    Vd, r = c["draft_vocab_size"], c.get("markov_rank") or 0
    if Vd < c["vocab_size"]:
        spec |= {"lm_head.weight": ((Vd, H), None), "d2t": ((Vd,), torch.int64), "t2d": ((c["vocab_size"],), torch.bool)}
    if r:
        spec |= {"markov_head.markov_w1.weight": ((c["vocab_size"], r), None),
                 "markov_head.markov_w2.weight": ((Vd, r), None)}
    if c.get("enable_confidence_head"):
        width = H + (r if c.get("confidence_head_with_markov") else 0)
        spec |= {"confidence_head.proj.weight": ((1, width), None), "confidence_head.proj.bias": ((1,), None)}
    return spec


def is_dspark(cfg: dict[str, Any]) -> bool:
    """A drafter with DSpark's heads (a Markov head, a confidence head)."""
    return bool(cfg.get("markov_rank") or cfg.get("confidence_head"))


def qwen3_layer_config(cfg: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The draft layers as a Qwen3 config (the architecture the engines build DFlash layers from)."""
    g = cfg["layer"]
    rope = dict(g.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    n = cfg["num_layers"]
    return {"model_type": "qwen3", "hidden_size": g["hidden_size"], "intermediate_size": g["intermediate_size"],
            "num_hidden_layers": n, "num_attention_heads": g["num_attention_heads"],
            "num_key_value_heads": g["num_key_value_heads"], "head_dim": g["head_dim"], "rms_norm_eps": g["rms_norm_eps"],
            "max_position_embeddings": g["max_position_embeddings"], "vocab_size": cfg["vocab_size"],
            "hidden_act": "silu", "rope_theta": float(rope.get("rope_theta", 1e4)), "rope_parameters": rope,
            "attention_bias": bool(g.get("attention_bias")), "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * n, "use_sliding_window": False, "torch_dtype": dtype}


def _checked(cfg: dict[str, Any]) -> int:
    """The target's layer count, after refusing what vLLM's DFlash layer cannot run."""
    if not cfg.get("qk_norm", True):
        raise ExportError("this DFlash drafter has no q/k norms (qk_norm=false), but vLLM's and SGLang's DFlash layers "
                          "always apply them; retrain with dflash.qk_norm=true")
    if cfg.get("correction_rank"):
        raise ExportError(f"this DFlash drafter has a path correction (correction_rank={cfg['correction_rank']}), "
                          "which no engine's DFlash layer computes; decode it with headway, or retrain with "
                          "dflash.correction_rank=0 to serve it in vLLM or SGLang")
    L = int((cfg.get("target") or {}).get("num_hidden_layers") or 0)
    if not L:
        raise ExportError("the checkpoint records no target (num_hidden_layers); cannot check its DFlash layers")
    bad = [i for i in cfg["aux_layers"] if not 1 <= i < L]
    if bad:
        raise ExportError(f"DFlash aux layers {bad} cannot be exported for a {L}-layer target: the engines capture "
                          f"decoder-layer outputs 1..{L - 1} before the final norm (index 0 is the embeddings, {L} "
                          f"is post-norm in transformers v5); retrain with aux_layers inside 1..{L - 1}")
    return L


def dflash_vllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None, dtype: str) -> Export:
    """The reference layout (vLLM ``method: dflash``, SGLang ``DFLASH``)."""
    if is_dspark(cfg):
        raise ExportError("this DFlash drafter has DSpark heads (markov_rank / confidence_head), which vLLM serves "
                          "only from speculators' dspark layout: export --format speculators")
    L = _checked(cfg)
    ids = [i - 1 for i in cfg["aux_layers"]]
    Vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    config = qwen3_layer_config(cfg, dtype) | {
        "architectures": [SPECULATORS_ARCH], "block_size": cfg["block_size"], "num_target_layers": L,
        "dflash_config": {"mask_token_id": cfg["mask_token_id"], "target_layer_ids": ids,
                          "block_size": cfg["block_size"]},
        "draft_vocab_size": Vd, "target_hidden_size": cfg["hidden_size"], "num_aux_layers": len(ids),
        "headway": _provenance(cfg, "vllm", aux_layers_hf_index=list(cfg["aux_layers"]), aux_layers_written=ids,
                               aux_layer_convention="decoder-layer output (HF output_hidden_states index - 1)")}
    k = cfg["block_size"] - 1
    notes = [f"vLLM: `vllm serve TARGET --speculative-config '{{\"method\": \"dflash\", \"model\": \"THIS_FOLDER\", "
             f"\"num_speculative_tokens\": {k}}}'`",
             f"SGLang: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
             f"--speculative-draft-model-path THIS_FOLDER --speculative-num-draft-tokens {cfg['block_size']}`"]
    return Export(config, dict(t), dflash_spec(config), notes=notes)


def dflash_speculators(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                       dtype: str) -> Export:
    """The speculators layout: ``vllm serve THIS_FOLDER`` finds the target (its verifier) by itself."""
    from .export_speculators import _verifier, proposal

    _checked(cfg)
    verifier = _verifier(cfg)
    layer = qwen3_layer_config(cfg, dtype)
    layer.pop("torch_dtype")
    Vd = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    k = cfg["block_size"] - 1
    kind, arch, heads = "dflash", SPECULATORS_ARCH, {}
    if is_dspark(cfg):
        if not cfg.get("markov_rank"):
            raise ExportError("this DFlash drafter has a confidence head but no Markov head, and vLLM's DSpark model "
                              "always has one (qwen3_dspark.py); retrain with dflash.markov_rank > 0")
        kind, arch = "dspark", "DSparkSpeculator"
        heads = {"markov_rank": cfg["markov_rank"], "markov_head_type": "vanilla",
                 "enable_confidence_head": bool(cfg.get("confidence_head")),
                 "confidence_head_with_markov": bool(cfg.get("confidence_head") and cfg.get("confidence_with_markov")),
                 "sample_from_anchor": False}
    config = {"architectures": [arch], "speculators_model_type": kind,
              "speculators_config": proposal(kind, k, verifier), **heads,
              "transformer_layer_config": layer, "draft_vocab_size": Vd, "block_size": cfg["block_size"],
              "target_hidden_size": cfg["hidden_size"], "aux_hidden_state_layer_ids": list(cfg["aux_layers"]),
              "mask_token_id": cfg["mask_token_id"], "torch_dtype": dtype,
              "headway": _provenance(cfg, "speculators", aux_layers_hf_index=list(cfg["aux_layers"]),
                                     aux_layers_written=list(cfg["aux_layers"]),
                                     aux_layer_convention="HF output_hidden_states index")}
    flat = layer | heads | {"target_hidden_size": cfg["hidden_size"], "draft_vocab_size": Vd,
                            "num_aux_layers": len(cfg["aux_layers"])}
    notes = [f"vLLM: `vllm serve THIS_FOLDER` or `LLM(model=THIS_FOLDER)` — the verifier `{verifier['name_or_path']}` "
             f"named in config.json is loaded as the target; {k} drafted tokens per step"]
    if kind == "dspark":
        notes.append("vLLM runs DSpark on its GPU model runner (V2); with `enable_adaptive_verification` the "
                     "confidence head sizes each step's verification")
    return Export(config, dict(t), dflash_spec(flat), notes=notes)


# -- import -------------------------------------------------------------------------------------------
def is_dflash_config(cfg: dict[str, Any]) -> bool:
    return "dflash_config" in cfg or cfg.get("speculators_model_type") in ("dflash", "dspark")


def dspark_options(cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """DFlashConfig's DSpark fields from a speculators ``dspark`` config; what headway's block cannot run
    (slots predicting anchor + k + 1, another Markov head) is refused."""
    if cfg.get("speculators_model_type") != "dspark":
        return {}
    if cfg.get("sample_from_anchor", True):  # speculators' trainer defaults to true when it writes none
        raise HeadsError(f"{where}: this DSpark drafter samples from the anchor (sample_from_anchor=true: slot k "
                         "predicts the token at anchor + k + 1); headway's DFlash block predicts anchor + k "
                         "(sample_from_anchor=false), so it cannot run it")
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise HeadsError(f"{where}: markov_head_type={cfg['markov_head_type']!r}; only the 'vanilla' Markov head "
                         "(the one vLLM builds) is supported")
    conf = bool(cfg.get("enable_confidence_head"))
    return {"markov_rank": int(cfg.get("markov_rank") or 0), "confidence_head": conf,
            "confidence_with_markov": bool(cfg.get("confidence_head_with_markov")) if conf else True}


def _geometry(layer: dict[str, Any]) -> LayerGeometry:
    from transformers import Qwen3Config

    from .eagle_import import hf_config

    inner = {k: v for k, v in layer.items() if k not in ("architectures", "auto_map", "model_type")}
    return LayerGeometry.from_target(hf_config(Qwen3Config, inner))


def import_dflash(name_or_path: str | Path, target: nn.Module | None = None, revision: str | None = None
                  ) -> DFlashDrafter:
    """A folder (or Hub id) in either layout -> a native drafter; with ``target`` it is checked (hidden
    and vocabulary sizes, naming both values) and attached."""
    from .eagle_import import read_weights, resolve_reference

    path = resolve_reference(name_or_path, revision)
    if not (path / "config.json").is_file():
        raise HeadsError(f"{path} has no config.json")
    cfg = read_json_object(path / "config.json", HeadsError)
    if not is_dflash_config(cfg):
        raise HeadsError(f"{path}/config.json is not a DFlash config (no dflash_config, no speculators_model_type: "
                         "dflash)")
    tensors = {k.removeprefix("model."): v for k, v in read_weights(path).items()}
    if cfg.get("speculators_model_type") in ("dflash", "dspark"):
        layer, aux = dict(cfg["transformer_layer_config"]), [int(i) for i in cfg["aux_hidden_state_layer_ids"]]
        mask, block = cfg.get("mask_token_id"), cfg.get("block_size")
    else:
        d = cfg["dflash_config"]
        layer, aux = cfg, [int(i) + 1 for i in d["target_layer_ids"]]
        mask, block = d.get("mask_token_id"), d.get("block_size") or cfg.get("block_size")
    if mask is None or block is None:
        raise HeadsError(f"{path}: a DFlash config names its mask_token_id and block_size; this one lacks "
                         f"{'mask_token_id' if mask is None else 'block_size'}")
    g = _geometry(layer)
    g.attention_bias = "layers.0.self_attn.q_proj.bias" in tensors
    vocab = int(layer.get("vocab_size") or cfg.get("vocab_size"))
    th = cfg.get("target_hidden_size")
    if th is not None and int(th) != g.hidden_size:
        raise HeadsError(f"this DFlash drafter has hidden_size={g.hidden_size} but target_hidden_size={th}; "
                         "headway drafters share the target's hidden size")
    reduced = "lm_head.weight" in tensors and tensors["lm_head.weight"].shape[0] < vocab
    tensors = {k: v for k, v in tensors.items() if k not in ("embed_tokens.weight", "lm_head.weight") or reduced}
    if reduced and "t2d" not in tensors:
        from .eagle_import import t2d_from_d2t

        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], vocab)
    config = DFlashConfig(hidden_size=g.hidden_size, vocab_size=vocab, block_size=int(block),
                          num_layers=int(layer["num_hidden_layers"]), aux_layers=aux, mask_token_id=int(mask),
                          draft_vocab_size=int(tensors["lm_head.weight"].shape[0]) if reduced else None,
                          qk_norm="layers.0.self_attn.q_norm.weight" in tensors, layer=g,
                          **dspark_options(cfg, path))
    drafter = DFlashDrafter(config)
    own = drafter.state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise HeadsError(f"{path}: tensors do not match a DFlash drafter; missing {missing[:6]}, "
                         f"unexpected {unexpected[:6]}")
    for k, v in tensors.items():
        if own[k].shape != v.shape:
            raise HeadsError(f"{path}: tensor '{k}' has shape {tuple(v.shape)}, but the drafter described by "
                             f"config.json needs {tuple(own[k].shape)}")
    drafter.load_state_dict({k: v.long() if k == "d2t" else v.bool() if k == "t2d" else v.float()
                             for k, v in tensors.items()}, strict=True)
    kind = cfg.get("speculators_model_type")
    drafter.metadata["imported"] = {"source": str(name_or_path),
                                    "layout": f"speculators-{kind}" if kind else "dflash-reference"}
    if target is not None:
        drafter.attach(target)
        drafter.to(device=target.get_output_embeddings().weight.device)
    return drafter.eval()
