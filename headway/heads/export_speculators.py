"""``headway export --format speculators``: the config format of the ``speculators`` library, which
vLLM detects by itself (``vllm serve DRAFTER`` / ``LLM(model=DRAFTER)``: the drafter's config
names the verifier, so the target need not be given).

Facts from vLLM 0.32.0 (``transformers_utils/config.py: maybe_override_with_speculators``,
``transformers_utils/configs/speculators/{base,algos}.py``, ``model_executor/models/llama_eagle3.py``):

- Detection: a top-level ``speculators_config``. It must hold ``proposal_methods[0].speculative_tokens``
  (the default draft length; a user's ``speculative_config`` overrides it) and
  ``verifier.name_or_path``, which vLLM loads as the target (and its tokenizer). The config also needs
  ``speculators_model_type`` and a ``transformer_layer_config`` dict (the drafter layer's Llama config,
  ``model_type: llama``).
- vLLM 0.32.0 knows the types ``eagle3``, ``peagle``, ``dflash``, ``dflash2``, ``dspark``: there is no
  EAGLE-1 (``eagle``) or Medusa speculators type, so those heads are refused here (``--format vllm``
  serves them). ``peagle`` is written by ``peagle_formats.py``, ``dflash`` and ``dspark`` by
  ``dflash_formats.py``.
- ``eagle3`` reads the top-level ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (HF hidden-state indices, as vLLM's own EAGLE-3 config) and
  ``norm_before_residual``, which **defaults to true** there: headway's layer adds the un-normalised
  hidden state as the residual, so its value is always written: false unless the drafter was trained
  (or imported) with it, as are ``norm_before_fc`` (then ``input_norm.weight [3H]``) and ``norm_output``
  (the post-norm state fed to the next draft step); ``fc_norm``, which headway does not train, is false.
- Tensors as the speculators library names them: ``layers.0.*`` (vLLM also takes ``midlayer.*``),
  ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (loaded as ``draft_id_to_target_id``)
  and ``t2d`` (skipped by vLLM, kept for other readers).
"""

from __future__ import annotations

from typing import Any

import torch

from .export_layouts import (Export, ExportError, Spec, _provenance, eagle3_spec, engine_aux_layers,
                             engine_norm_options, llama_config)

SPECULATIVE_TOKENS = 3  # the default draft length written into proposal_methods
LAYER_PREFIX = "layers.0."


def speculators_eagle3_spec(c: dict[str, Any]) -> Spec:
    """The EAGLE-3 spec with the drafter layer under ``layers.0.``."""
    flat = {"hidden_size": c["transformer_layer_config"]["hidden_size"], **c["transformer_layer_config"],
            "draft_vocab_size": c["draft_vocab_size"], "target_hidden_size": c["target_hidden_size"],
            "norm_before_fc": c.get("norm_before_fc", False)}
    return {_renamed(k): v for k, v in eagle3_spec(flat).items()}


def _renamed(name: str) -> str:
    return LAYER_PREFIX + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def proposal(algorithm: str, tokens: int, verifier: dict[str, Any]) -> dict[str, Any]:
    """The ``speculators_config`` block: one greedy proposal of ``tokens`` drafts (vLLM's default draft
    length for the folder) and the verifier vLLM loads as the target."""
    method = {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
    return {"algorithm": algorithm, "default_proposal_method": "greedy", "proposal_methods": [method],
            "verifier": verifier}


def _verifier(cfg: dict[str, Any]) -> dict[str, Any]:
    target = cfg.get("target") or {}
    if not target.get("name_or_path") or not target.get("num_hidden_layers"):
        raise ExportError("the checkpoint records no target (name_or_path, num_hidden_layers), which the "
                          "speculators format must name as its verifier")
    return {"name_or_path": target["name_or_path"],
            "architectures": [target["architecture"]] if target.get("architecture") else []}


def eagle3_speculators(cfg: dict[str, Any], t: dict[str, torch.Tensor], lm_head: torch.Tensor | None,
                       dtype: str) -> Export:
    opts = engine_norm_options(cfg, "speculators")
    verifier = _verifier(cfg)
    ids = engine_aux_layers(list(cfg["aux_layers"]), int(cfg["target"]["num_hidden_layers"]), "vllm")
    layer = llama_config(cfg, "LlamaForCausalLM", dtype)
    layer.pop("torch_dtype")
    config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
              "speculators_config": proposal("eagle3", SPECULATIVE_TOKENS, verifier),
              "transformer_layer_config": layer, "draft_vocab_size": cfg["draft_vocab_size"],
              "target_hidden_size": cfg["hidden_size"], "eagle_aux_hidden_state_layer_ids": ids,
              **opts, "fc_norm": False,
              "tie_word_embeddings": False, "torch_dtype": dtype,
              "headway": _provenance(cfg, "speculators", aux_layers_hf_index=list(cfg["aux_layers"]),
                                     aux_layers_written=ids, aux_layer_convention="HF output_hidden_states index")}
    notes = [f"vLLM: `vllm serve THIS_FOLDER` or `LLM(model=THIS_FOLDER)` — the verifier "
             f"`{verifier['name_or_path']}` named in config.json is loaded as the target; draft length "
             f"{SPECULATIVE_TOKENS} unless `speculative_config={{\"num_speculative_tokens\": N}}` says otherwise"]
    return Export(config, {_renamed(k): v for k, v in t.items()}, speculators_eagle3_spec(config), notes=notes)


def why_not(kind: str) -> str:
    """Why ``kind`` has no speculators form (for the refusal)."""
    return (f"{kind} heads have no speculators form that vLLM loads (vLLM 0.32.0 knows the speculators types "
            "eagle3, peagle, dflash, dflash2, dspark); export --format vllm")
