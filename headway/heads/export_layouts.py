"""What each engine reads: spec tables and one converter per (head kind, engine).

Each converter returns the engine's ``config.json`` and tensors; ``check_tensors`` holds them to
the engine's spec table (names, shapes, dtypes: a function of the config being written, so config
and weights cannot disagree). ``export.py`` picks the converter and writes the folder.

Engine facts these functions rely on, read from the engines' sources (vLLM 0.32.0 as installed by
``checks/vllm_parity.py``; SGLang ``python/sglang/srt/models/llama_eagle{,3}.py`` and
``llama.py``; TensorRT-LLM ``examples/medusa/convert_checkpoint.py`` and
``tensorrt_llm/models/medusa/weight.py``):

- **vLLM Medusa** (``models/medusa.py``, ``configs/medusa.py``): ResBlock linears have a bias only
  when ``medusa_fc_bias`` is set — otherwise bias tensors are *silently dropped*; tensor names the
  model lacks are ignored; every top-level config key containing "num" and "heads" (or "layers")
  is renamed to ``num_heads`` (``num_hidden_layers``), so no other such key may be written.
  ``num_hidden_layers`` is the number of ResBlocks per head. One ``lm_heads.{h}`` per head.
  A reduced vocabulary: config ``truncated_vocab_size`` N < ``vocab_size`` plus a ``token_map``
  tensor (N,) of target ids (draft id i -> ``token_map[i]``; the head's logits are scattered there,
  -inf elsewhere); ``lm_heads.{h}.weight`` then has N rows (it is sliced by ``token_map`` only when
  it has more). Without ``token_map`` vLLM asserts N == vocab_size.
- **vLLM EAGLE-1** (``models/llama_eagle.py``): ``fc`` is ``Linear(2H, H, bias=False)``; layer 0
  has no ``input_layernorm``; ``embed_tokens`` and ``lm_head`` come from the target when absent.
- **SGLang EAGLE-1** (``LlamaForCausalLMEagle``): ``fc`` is ``nn.Linear(2H, H)`` *with* a bias,
  and the loader skips tensors it is not given, so ``fc.bias`` is always written (zeros when the
  heads have none) — otherwise it would keep its random initialisation.
- **EAGLE-3** (vLLM ``models/llama_eagle3.py``, SGLang ``llama_eagle3.py``): tensors under
  ``midlayer.`` (vLLM maps them to ``layers.0.``), ``d2t`` (vLLM: ``draft_id_to_target_id``;
  SGLang: hot token ids = ``d2t + arange``), ``t2d`` (both skip it). Aux layers: headway stores HF
  ``output_hidden_states`` indices. vLLM captures ``hidden + residual`` entering decoder layer i
  for id i — the same numbers — and reads the top-level ``eagle_aux_hidden_state_layer_ids``
  (one code path also ``eagle_config``'s); SGLang reads only ``eagle_config``'s and captures
  entering layer ``id + 1``, so SGLang gets HF index − 1. Index L (the last layer's output) is
  *post*-norm in transformers v5 but captured *pre*-norm by both engines: refused.
- **TensorRT-LLM Medusa**: ``convert_checkpoint.py --medusa_model_dir DIR`` reads
  ``DIR/config.json`` (``medusa_num_heads``, ``medusa_num_layers``) and
  ``DIR/medusa_lm_head.safetensors`` (or ``.pt``) with the FasterDecoding names
  ``{h}.{l}.linear.weight``, ``{h}.{l}.linear.bias`` (read unconditionally: zeros are written
  when the heads have no bias) and ``{h}.{L}.weight`` (the head's vocab projection). Its
  ``--num_medusa_heads`` defaults to 4 and wins over the config: pass it explicitly. The target
  itself is converted by TensorRT-LLM (``--model_dir``), not here. It has no reduced draft
  vocabulary (each projection is vocab_size rows): heads with one are refused.
- **TensorRT-LLM EAGLE-3** (PyTorch backend only; ``tensorrt_llm/_torch/models/modeling_speculative.py``:
  ``Eagle3ForCausalLM.load_weights``, ``Eagle3DraftModel``, ``Eagle3DecoderLayer``): the draft config is
  read with ``ModelConfig.from_pretrained`` (Llama fields, ``draft_vocab_size``, ``target_hidden_size``;
  ``eagle_config`` flags such as ``norm_before_fc`` stay unset); tensors ``midlayer.*`` (``layers.0.*``
  is renamed to it), ``fc.weight`` (a bias only when the config says ``bias``), ``norm.weight``,
  ``lm_head.weight`` (else the target's), ``d2t`` (only when draft_vocab_size != vocab_size); other
  names such as ``t2d`` are not parameters there. The target layers come from
  ``Eagle3DecodingConfig.eagle3_layers_to_capture`` (``tensorrt_llm/llmapi/llm_args.py``; default
  {1, L//2-1, L-4}), captured as ``hidden + residual`` after layer id: HF index - 1, as SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import __version__
from ..errors import HeadwayError
from .configs import EXPORT_DTYPES, EXPORT_FORMATS
from .load import heads_class

FORMATS = EXPORT_FORMATS
DTYPES = dict(zip(EXPORT_DTYPES, (torch.float32, torch.bfloat16, torch.float16)))

Shape = tuple[int, ...]
Spec = dict[str, tuple[Shape, torch.dtype | None]]  # tensor name -> (shape, dtype or None = any float)
OUTPUT_NUMBERED = ("sglang", "trtllm")  # engines whose EAGLE-3 aux id k is the output of layer k (HF index k+1)


class ExportError(HeadwayError):
    """Heads cannot be exported to the asked engine format; the message says why."""


@dataclass
class Export:
    """What one engine reads: its config, its tensors, and the names of the files to write."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    spec: Spec
    weights_file: str = "model.safetensors"
    notes: list[str] = field(default_factory=list)  # how to load it, for the README


# -- spec tables: what each engine expects, as a function of the config we write -----------------
def medusa_vllm_spec(c: dict[str, Any]) -> Spec:
    K, L, H, V, N = c["num_heads"], c["num_hidden_layers"], c["hidden_size"], c["vocab_size"], c["truncated_vocab_size"]
    spec: Spec = {}
    for h in range(K):
        for l in range(L):
            spec[f"blocks.{h}.layers.{l}.weight"] = ((H, H), None)
            if c["medusa_fc_bias"]:
                spec[f"blocks.{h}.layers.{l}.bias"] = ((H,), None)
        spec[f"lm_heads.{h}.weight"] = ((N, H), None)
    if N < V:
        spec["token_map"] = ((N,), torch.int64)
    return spec


def medusa_trtllm_spec(c: dict[str, Any]) -> Spec:
    K, L, H, V = c["medusa_num_heads"], c["medusa_num_layers"], c["hidden_size"], c["vocab_size"]
    spec: Spec = {}
    for h in range(K):
        for l in range(L):
            spec[f"{h}.{l}.linear.weight"] = ((H, H), None)
            spec[f"{h}.{l}.linear.bias"] = ((H,), None)
        spec[f"{h}.{L}.weight"] = ((V, H), None)
    return spec


def _layer_spec(c: dict[str, Any], prefix: str, attn_in: int) -> Spec:
    H, I = c["hidden_size"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {f"{prefix}self_attn.q_proj.weight": ((q, attn_in), None),
            f"{prefix}self_attn.k_proj.weight": ((kv, attn_in), None),
            f"{prefix}self_attn.v_proj.weight": ((kv, attn_in), None),
            f"{prefix}self_attn.o_proj.weight": ((H, q), None),
            f"{prefix}mlp.gate_proj.weight": ((I, H), None),
            f"{prefix}mlp.up_proj.weight": ((I, H), None),
            f"{prefix}mlp.down_proj.weight": ((H, I), None),
            f"{prefix}post_attention_layernorm.weight": ((H,), None)}


def eagle1_spec(c: dict[str, Any], fc_bias: bool) -> Spec:
    """No input_layernorm, no final norm, no lm_head: those come from (or are absent in) the engine."""
    H = c["hidden_size"]
    spec: Spec = {"fc.weight": ((H, 2 * H), None), **_layer_spec(c, "layers.0.", H)}
    if fc_bias:
        spec["fc.bias"] = ((H,), None)
    return spec


def eagle3_spec(c: dict[str, Any]) -> Spec:
    """The EAGLE-3 layout; ``input_norm.weight [3H]`` too when the config says ``norm_before_fc``."""
    H, Ht = c["hidden_size"], c["target_hidden_size"]
    return {"fc.weight": ((H, 3 * Ht), None),
            **({"input_norm.weight": ((3 * Ht,), None)} if c.get("norm_before_fc") else {}),
            "midlayer.input_layernorm.weight": ((H,), None),
            "midlayer.hidden_norm.weight": ((H,), None),
            **_layer_spec(c, "midlayer.", 2 * H),
            "norm.weight": ((H,), None),
            "lm_head.weight": ((c["draft_vocab_size"], H), None),
            "d2t": ((c["draft_vocab_size"],), torch.int64),
            "t2d": ((c["vocab_size"],), torch.bool)}


def check_tensors(tensors: dict[str, torch.Tensor], spec: Spec, where: str) -> None:
    """Names, shapes and dtypes against a spec; the error names the first problems found."""
    missing = sorted(set(spec) - set(tensors))
    unexpected = sorted(set(tensors) - set(spec))
    if missing or unexpected:
        raise ExportError(f"{where}: tensors do not match; missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, (shape, dtype) in spec.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ExportError(f"{where}: tensor '{name}' has shape {tuple(t.shape)}, expected {shape}")
        if dtype is not None and t.dtype != dtype:
            raise ExportError(f"{where}: tensor '{name}' has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not t.is_floating_point():
            raise ExportError(f"{where}: tensor '{name}' has dtype {t.dtype}, expected a floating type")


def native_spec(cfg: dict[str, Any]) -> Spec:
    """The native checkpoint's tensors for this config: the module built on the meta device."""
    try:
        with torch.device("meta"):
            module = heads_class(cfg["kind"])._from_config_dict(cfg)
    except (TypeError, ValueError, KeyError) as e:
        raise ExportError(f"the heads config is invalid: {e}") from None
    return {k: (tuple(v.shape), None if v.is_floating_point() else v.dtype) for k, v in module.state_dict().items()}


# -- configs ------------------------------------------------------------------------------------
def _provenance(cfg: dict[str, Any], fmt: str, **extra: Any) -> dict[str, Any]:
    return {"kind": cfg["kind"], "format": fmt, "exported_by": f"headway {__version__}",
            "trained_with": cfg.get("headway_version"), "target": cfg.get("target"), **extra}


def llama_config(cfg: dict[str, Any], architecture: str, dtype: str) -> dict[str, Any]:
    """A one-layer Llama config with the drafter layer's geometry (transformers v4 and v5 keys)."""
    g = cfg["layer"]
    rope = dict(g.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0})
    scaling = None if rope.get("rope_type", "default") == "default" else \
        {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"architectures": [architecture], "model_type": "llama", "hidden_size": g["hidden_size"],
            "intermediate_size": g["intermediate_size"], "num_attention_heads": g["num_attention_heads"],
            "num_key_value_heads": g["num_key_value_heads"], "head_dim": g["head_dim"], "num_hidden_layers": 1,
            "rms_norm_eps": g["rms_norm_eps"], "max_position_embeddings": g["max_position_embeddings"],
            "vocab_size": cfg["vocab_size"], "hidden_act": "silu", "rope_theta": float(rope.get("rope_theta", 1e4)),
            "rope_scaling": scaling, "rope_parameters": rope, "attention_bias": bool(g.get("attention_bias")),
            "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype}


# -- one function per (kind, engine) ------------------------------------------------------------
def _per_head_lm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                 engine: str) -> list[torch.Tensor]:
    """Each head's vocab projection; heads that share the target's lm_head get a copy of it."""
    K = cfg["num_heads"]
    if cfg["own_lm_head"]:
        return [t[f"lm_heads.{h}.weight"] for h in range(K)]
    if lm_head is None:
        raise ExportError(f"these Medusa heads share the target's lm_head (own_lm_head=false), but {engine} "
                          "needs one vocab projection per head: pass the target (--target) so export can copy it")
    return [lm_head.clone() for _ in range(K)]  # distinct tensors: safetensors refuses shared memory


def medusa_vllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                dtype: str) -> Export:
    K, L, V = cfg["num_heads"], cfg["num_layers"], cfg["vocab_size"]
    N = cfg.get("draft_vocab_size") or V
    tensors = {k: v for k, v in t.items() if k.startswith("blocks.")}
    tensors |= {f"lm_heads.{h}.weight": w for h, w in enumerate(_per_head_lm(cfg, t, lm_head, "vLLM"))}
    if N < V:  # vLLM's truncated vocabulary: token_map[i] = the target id of draft id i
        tensors["token_map"] = torch.arange(N, dtype=torch.int64) + t["d2t"].to(torch.int64)
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": K, "num_hidden_layers": L,
              "hidden_size": cfg["hidden_size"], "vocab_size": V, "truncated_vocab_size": N,
              "medusa_fc_bias": bool(cfg["bias"]), "torch_dtype": dtype, "headway": _provenance(cfg, "vllm")}
    notes = ["vLLM: `LLM(model=TARGET, speculative_config={\"method\": \"medusa\", \"model\": THIS_FOLDER, "
             f"\"num_speculative_tokens\": {K}}})`"]
    return Export(config, tensors, medusa_vllm_spec(config), notes=notes)


def medusa_trtllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                  dtype: str) -> Export:
    K, L, H = cfg["num_heads"], cfg["num_layers"], cfg["hidden_size"]
    if cfg.get("draft_vocab_size") is not None and cfg["draft_vocab_size"] < cfg["vocab_size"]:
        raise ExportError(f"these Medusa heads draft over a reduced vocabulary ({cfg['draft_vocab_size']} of "
                          f"{cfg['vocab_size']} tokens), which TensorRT-LLM's Medusa cannot load (its projections "
                          "cover the full vocabulary); export --format vllm (truncated_vocab_size + token_map)")
    tensors: dict[str, torch.Tensor] = {}
    for h, w in enumerate(_per_head_lm(cfg, t, lm_head, "TensorRT-LLM")):
        for l in range(L):
            tensors[f"{h}.{l}.linear.weight"] = t[f"blocks.{h}.layers.{l}.weight"]
            tensors[f"{h}.{l}.linear.bias"] = t.get(f"blocks.{h}.layers.{l}.bias", torch.zeros(H))
        tensors[f"{h}.{L}.weight"] = w
    target = cfg.get("target") or {}
    config = {"medusa_num_heads": K, "medusa_num_layers": L, "hidden_size": H, "vocab_size": cfg["vocab_size"],
              "base_model_name_or_path": target.get("name_or_path"), "torch_dtype": dtype,
              "headway": _provenance(cfg, "trtllm")}
    notes = ["TensorRT-LLM: `python examples/medusa/convert_checkpoint.py --model_dir TARGET "
             f"--medusa_model_dir THIS_FOLDER --num_medusa_heads {K} --num_medusa_layers {L} "
             "--output_dir CKPT --dtype float16`, then `trtllm-build --checkpoint_dir CKPT "
             "--speculative_decoding_mode medusa ...` (pass --num_medusa_heads: its default 4 wins over the config)"]
    return Export(config, tensors, medusa_trtllm_spec(config), "medusa_lm_head.safetensors", notes)


def eagle1_tensors(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """EAGLE-1's tensors for an engine. The engines share the target's lm_head and draft over the
    full vocabulary, so a draft vocabulary (d2t / t2d, used only by headway's decoder to slice
    that lm_head) is dropped: the export drafts exactly as the full-vocabulary drafter does."""
    return {k: v for k, v in t.items() if k not in ("d2t", "t2d")}


def eagle1_vllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                dtype: str) -> Export:
    if cfg["fc_bias"]:
        raise ExportError("these EAGLE-1 heads have a bias on fc (fc_bias=true), but vLLM's EAGLE-1 fc has none "
                          "(llama_eagle.py: Linear(2H, H, bias=False)) and would run a different model; retrain "
                          "with fc_bias=false, or export --format sglang")
    config = llama_config(cfg, "EagleLlamaForCausalLM", dtype) | {"headway": _provenance(cfg, "vllm")}
    notes = ["vLLM: `LLM(model=TARGET, speculative_config={\"method\": \"eagle\", \"model\": THIS_FOLDER, "
             "\"num_speculative_tokens\": 4})` (embed_tokens and lm_head are shared with the target)"]
    return Export(config, eagle1_tensors(t), eagle1_spec(config, fc_bias=False), notes=notes + _full_vocab_note(cfg))


def eagle1_sglang(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                  dtype: str) -> Export:
    tensors = eagle1_tensors(t)
    tensors.setdefault("fc.bias", torch.zeros(cfg["hidden_size"]))  # SGLang's fc has a bias: zero = none
    config = llama_config(cfg, "LlamaForCausalLMEagle", dtype) | {"headway": _provenance(cfg, "sglang")}
    notes = ["SGLang: `python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE "
             "--speculative-draft-model-path THIS_FOLDER --speculative-num-steps 4 --speculative-eagle-topk 1 "
             "--speculative-num-draft-tokens 5`"]
    return Export(config, tensors, eagle1_spec(config, fc_bias=True), notes=notes + _full_vocab_note(cfg))


def _full_vocab_note(cfg: dict[str, Any]) -> list[str]:
    n = cfg.get("draft_vocab_size")
    if n is None or n >= cfg["vocab_size"]:
        return []
    return [f"Draft vocabulary: headway decodes this drafter over {n} of {cfg['vocab_size']} tokens; the engine "
            "drafts over the full vocabulary with the target's lm_head (same drafter, no vocabulary cut)"]


def engine_aux_layers(aux_layers: list[int], num_target_layers: int, engine: str) -> list[int]:
    """Headway's aux layers (HF hidden-state indices) as the engine numbers them: vLLM (and its
    speculators format) uses the same indices; SGLang and TensorRT-LLM capture the output of layer
    id (= entering layer id + 1), so they get index - 1."""
    L = num_target_layers
    if len(set(aux_layers)) != len(aux_layers):
        raise ExportError(f"EAGLE-3 aux layers must be distinct; got {aux_layers}")
    for i in aux_layers:
        if not 0 <= i < L:
            why = (f"index {i} = {L} is the last layer's output, which transformers v5 returns after the final "
                   "norm (what these heads were trained on) while the engines capture it before the norm")
            raise ExportError(f"EAGLE-3 aux layer {i} cannot be exported for a {L}-layer target: "
                              + (why if i == L else f"indices must be in 0..{L - 1}")
                              + f"; retrain with aux_layers inside 0..{L - 1}")
    return [i - 1 for i in aux_layers] if engine in OUTPUT_NUMBERED else list(aux_layers)


SPECULATORS_OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")
ENGINES_WITH_OPTIONS = ("vllm", "speculators")  # vLLM >= 0.32 computes all three (llama_eagle3.py)


def engine_norm_options(cfg: dict[str, Any], engine: str) -> dict[str, bool]:
    """speculators' EAGLE-3 norm options as the drafter was trained, for the config of an engine
    that computes them (vLLM reads each by name, from either format); an engine that does not
    (SGLang, TensorRT-LLM as checked) would serve wrong drafts from such a drafter: refused."""
    on = [k for k in SPECULATORS_OPTIONS if cfg.get(k)]
    if on and engine not in ENGINES_WITH_OPTIONS:
        raise ExportError(f"this EAGLE-3 drafter uses speculators' options {on} (imported from a speculators "
                          f"checkpoint, or trained with eagle.{on[0]}), which {engine} does not compute; "
                          f"export --format vllm or --format speculators, or decode with headway")
    return {k: bool(cfg.get(k)) for k in SPECULATORS_OPTIONS}


def _eagle3(cfg: dict[str, Any], t: dict[str, torch.Tensor], dtype: str, engine: str) -> Export:
    opts = engine_norm_options(cfg, engine)
    target = cfg.get("target") or {}
    if not target.get("num_hidden_layers"):
        raise ExportError("the checkpoint records no target (num_hidden_layers); cannot check its EAGLE-3 aux layers")
    ids = engine_aux_layers(list(cfg["aux_layers"]), int(target["num_hidden_layers"]), engine)
    config = llama_config(cfg, "LlamaForCausalLMEagle3", dtype)
    config |= {"draft_vocab_size": cfg["draft_vocab_size"], "target_hidden_size": cfg["hidden_size"],
               "norm_before_residual": opts["norm_before_residual"],
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
               "headway": _provenance(cfg, engine, aux_layers_hf_index=list(cfg["aux_layers"]),
                                      aux_layers_written=ids,
                                      aux_layer_convention="HF output_hidden_states index - 1"
                                      if engine in OUTPUT_NUMBERED else "HF output_hidden_states index")}
    if engine == "vllm":
        config["eagle_aux_hidden_state_layer_ids"] = ids  # the top-level key is the one every vLLM path reads
        config |= opts  # llama_eagle3.py reads each option from the config by name (false when absent)
    return Export(config, dict(t), eagle3_spec(config))  # norm_before_fc is written for vLLM, refused elsewhere


def eagle3_vllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                dtype: str) -> Export:
    ex = _eagle3(cfg, t, dtype, "vllm")
    ex.notes.append("vLLM: `LLM(model=TARGET, speculative_config={\"method\": \"eagle3\", \"model\": THIS_FOLDER, "
                    "\"num_speculative_tokens\": 4})`")
    return ex


def eagle3_sglang(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                  dtype: str) -> Export:
    ex = _eagle3(cfg, t, dtype, "sglang")
    ex.notes.append("SGLang: `python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 "
                    "--speculative-draft-model-path THIS_FOLDER --speculative-num-steps 4 "
                    "--speculative-eagle-topk 1 --speculative-num-draft-tokens 5`")
    return ex


def eagle3_trtllm(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                  dtype: str) -> Export:
    """TensorRT-LLM (PyTorch backend) reads the EAGLE-3 reference layout, the one SGLang reads."""
    ex = _eagle3(cfg, t, dtype, "trtllm")
    layers = ex.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ex.notes.append("TensorRT-LLM (PyTorch backend): `LLM(model=TARGET, speculative_config=Eagle3DecodingConfig("
                    "speculative_model=THIS_FOLDER, max_draft_len=4, "
                    f"eagle3_layers_to_capture={set(layers)}))` (pass the layers: TensorRT-LLM's default is "
                    "{1, L//2-1, L-4}, not the ones these heads were trained on)")
    return ex


