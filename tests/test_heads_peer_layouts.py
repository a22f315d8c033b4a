"""EAGLE-3 checkpoints as the peer trainers write them (speculators with its extra norms, ModelOpt's
``LlamaForCausalLMEagle3`` export, SpecForge's ``midlayer.*``), written here by hand from random
tensors, import into drafters whose outputs equal an independent computation of each trainer's
forward (plain torch below, following each trainer's code)."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from headway.heads import HeadsError
from headway.heads.eagle_import import import_eagle
from headway.heads.export import export_heads
from headway.heads.export_layouts import ExportError
from headway.train.ttt import ttt_mask

H, V, VD, L, NH, NKV, HD, I = 32, 96, 40, 6, 4, 2, 8, 64
EPS = 1e-6


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=L, num_attention_heads=NH,
                      num_key_value_heads=NKV, head_dim=HD, vocab_size=V, rms_norm_eps=EPS)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def layer_config(**extra):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": I,
            "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD, "num_hidden_layers": 1,
            "rms_norm_eps": EPS, "max_position_embeddings": 512, "vocab_size": V, **extra}


def random_tensors(prefix, norm_before_fc=False, seed=1):
    """Every tensor of a one-layer EAGLE-3 drafter, norms around 1, under ``prefix`` for the layer."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    n = lambda k: 1 + r(k)  # noqa: E731
    t = {"fc.weight": r(H, 3 * H), "norm.weight": n(H), "lm_head.weight": r(VD, H),
         f"{prefix}input_layernorm.weight": n(H), f"{prefix}hidden_norm.weight": n(H),
         f"{prefix}post_attention_layernorm.weight": n(H),
         f"{prefix}self_attn.q_proj.weight": r(NH * HD, 2 * H), f"{prefix}self_attn.k_proj.weight": r(NKV * HD, 2 * H),
         f"{prefix}self_attn.v_proj.weight": r(NKV * HD, 2 * H), f"{prefix}self_attn.o_proj.weight": r(H, NH * HD),
         f"{prefix}mlp.gate_proj.weight": r(I, H), f"{prefix}mlp.up_proj.weight": r(I, H),
         f"{prefix}mlp.down_proj.weight": r(H, I)}
    draft_ids = torch.randperm(V, generator=g)[:VD].sort().values
    t["d2t"] = draft_ids - torch.arange(VD)
    if norm_before_fc:
        t["input_norm.weight"] = n(3 * H)
    return t


def write(folder, config, tensors):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def reference_step(t, prefix, embed, ids, aux, pos, norm_before_fc=False, norm_before_residual=False,
                   norm_output=False):
    """One EAGLE-3 step as speculators' Eagle3DraftModel.forward / SpecForge / vLLM compute it:
    ids (B, T), aux 3 x (B, T, H), pos (B, T) -> (fed-back state (B, T, H), logits (B, T, VD))."""
    w = lambda k: t[prefix + k]  # noqa: E731
    x = torch.cat(aux, -1)  # (B, T, 3H)
    if norm_before_fc:
        x = rms(x, t["input_norm.weight"])
    h = x @ t["fc.weight"].T  # (B, T, H)
    e, hn = rms(embed(ids), w("input_layernorm.weight")), rms(h, w("hidden_norm.weight"))
    residual = hn if norm_before_residual else h
    a = torch.cat([e, hn], -1)  # (B, T, 2H)
    B, T, _ = a.shape
    q = (a @ w("self_attn.q_proj.weight").T).view(B, T, NH, HD).transpose(1, 2)
    k = (a @ w("self_attn.k_proj.weight").T).view(B, T, NKV, HD).transpose(1, 2)
    v = (a @ w("self_attn.v_proj.weight").T).view(B, T, NKV, HD).transpose(1, 2)
    from transformers import LlamaConfig

    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**layer_config()))(a, pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, NH, T, HD)
    h1 = residual + att.transpose(1, 2).reshape(B, T, -1) @ w("self_attn.o_proj.weight").T
    m = rms(h1, w("post_attention_layernorm.weight"))
    h2 = h1 + (F.silu(m @ w("mlp.gate_proj.weight").T) * (m @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
    normed = rms(h2, t["norm.weight"])
    return (normed if norm_output else h2), normed @ t["lm_head.weight"].T


def check_against_reference(drafter, t, prefix, target, hf_aux, **flags):
    assert drafter.feature_layers == hf_aux
    torch.manual_seed(5)
    ids = torch.randint(3, V, (2, 7))
    hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    aux = [hs[i] for i in hf_aux]
    pos = torch.arange(7)[None].expand(2, 7) + 3
    with torch.no_grad():
        out = drafter(ids, drafter.fuse(aux), pos, ttt_mask(7, 0, torch.float32, "cpu"))
        logits = drafter.logits(out)
        ref_out, ref_logits = reference_step(t, prefix, target.get_input_embeddings(), ids, aux, pos, **flags)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(drafter.draft_token_ids(), torch.arange(VD) + t["d2t"])


def speculators_config(aux_ids, **flags):
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer_config(), "draft_vocab_size": VD, "target_hidden_size": H,
            "eagle_aux_hidden_state_layer_ids": aux_ids, "fc_norm": False,
            "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "t"}}, **flags}


FLAGS = [dict(norm_before_fc=True, norm_before_residual=True, norm_output=True),  # speculators train's defaults
         dict(norm_before_fc=False, norm_before_residual=False, norm_output=False),
         dict(norm_before_fc=False, norm_before_residual=True, norm_output=False),
         dict(norm_before_fc=True, norm_before_residual=False, norm_output=True)]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "-".join(k for k, v in f.items() if v) or "none")
def test_speculators_checkpoint_with_its_norms(target, tmp_path, flags):
    t = random_tensors("layers.0.", norm_before_fc=flags["norm_before_fc"])
    t["embed_tokens.weight"] = torch.randn(V, H)  # saved by speculators, dropped (the target's is used)
    src = write(tmp_path / "spec", speculators_config([1, 3, 4], **flags), t)
    d = import_eagle(src, target=target)
    assert {k: getattr(d.config, k) for k in flags} == flags
    check_against_reference(d, t, "layers.0.", target, [1, 3, 4], **flags)  # speculators' ids: HF indices


def test_speculators_norms_survive_save_and_load(target, tmp_path):
    from headway.heads.load import load_heads

    flags = FLAGS[0]
    t = random_tensors("layers.0.", norm_before_fc=True)
    d = import_eagle(write(tmp_path / "spec", speculators_config([1, 3, 4], **flags), t), target=target)
    back = load_heads(d.save_pretrained(tmp_path / "native"), target=target)
    check_against_reference(back, t, "layers.0.", target, [1, 3, 4], **flags)
    with pytest.raises(ExportError, match="speculators' options"):  # SGLang does not compute them
        export_heads(tmp_path / "native", "sglang", tmp_path / "out")
    cfg = json.loads((export_heads(tmp_path / "native", "vllm", tmp_path / "vllm-out") / "config.json")
                     .read_text())  # vLLM does: served as trained
    assert {k: cfg[k] for k in flags} == flags


def test_speculators_fc_norm_is_refused(target, tmp_path):
    src = write(tmp_path / "spec", speculators_config([1, 3, 4], fc_norm=True), random_tensors("layers.0."))
    with pytest.raises(HeadsError, match="fc_norm"):
        import_eagle(src, target=target)


def modelopt_export_config(aux_ids):
    """What ModelOpt 0.47's EagleExporter writes (llama_eagle_template_config filled in)."""
    return {**layer_config(architectures=["LlamaForCausalLMEagle3"]), "draft_vocab_size": VD,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": False, "mlp_bias": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True,
                             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                             "use_mtp_layernorm": False, "next_layer_regular": True, "parallel_draft_step": 1,
                             "parallel_draft_heads_num_layers": 1}}


def test_modelopt_export_numbers_layer_outputs(target, tmp_path):
    """ModelOpt hooks ``layers[k]``'s output for id k: HF index k + 1. No t2d is written."""
    t = random_tensors("layers.0.")
    d = import_eagle(write(tmp_path / "mo", modelopt_export_config([0, 2, 3]), t), target=target)
    assert d.metadata["imported"]["aux_convention"] == "sglang"
    check_against_reference(d, t, "layers.0.", target, [1, 3, 4])


def test_specforge_checkpoint(target, tmp_path):
    """SpecForge's LlamaForCausalLMEagle3: midlayer.*, embed_tokens, t2d, ids under eagle_config (layer outputs)."""
    t = random_tensors("midlayer.")
    t["t2d"] = torch.zeros(V, dtype=torch.bool)
    t["t2d"][torch.arange(VD) + t["d2t"]] = True
    t["embed_tokens.weight"] = torch.randn(V, H)
    cfg = {**layer_config(architectures=["LlamaForCausalLMEagle3"]), "draft_vocab_size": VD,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    d = import_eagle(write(tmp_path / "sf", cfg, t), target=target)
    check_against_reference(d, t, "midlayer.", target, [2, 3, 4])
