"""Write a tiny Llama as a GGUF file with the ``gguf`` package, so conversion tests download nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary pairs); transformers' GGUF loader undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(model: Any, tokenizer: Any, path: Path) -> Path:
    """``model``: a transformers LlamaForCausalLM; ``tokenizer``: a byte-level BPE fast tokenizer."""
    import gguf

    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tok = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    for added in tok["added_tokens"]:
        assert vocab[added["id"]][0] == added["content"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {a["id"] for a in tok["added_tokens"]}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(vocab))])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _rope_permute(sd[p + "self_attn.q_proj.weight"], nh))
        w.add_tensor(f"blk.{i}.attn_k.weight", _rope_permute(sd[p + "self_attn.k_proj.weight"], nkv))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:  # llama.cpp leaves the output matrix out of a tied model
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
