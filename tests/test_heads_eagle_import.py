"""Import of reference EAGLE-1 / EAGLE-3 layouts: synthetic checkpoints written from a native
drafter in each layout import back to identical tensors and outputs; bad ones are refused."""

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from headway.heads import Eagle1Drafter, Eagle3Drafter, HeadsError, default_aux_layers
from headway.heads.eagle_import import import_eagle
from headway.target import TargetError
from headway.testing import tiny_target
from headway.train.ttt import ttt_mask


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM, LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=384, max_position_embeddings=1024, rope_parameters=rope)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def randomize(d):
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return d


def llama_fields(d, **extra):
    g = d.config.layer
    rope = dict(g.rope_parameters)
    theta = rope.pop("rope_theta")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g.hidden_size,
            "intermediate_size": g.intermediate_size, "num_attention_heads": g.num_attention_heads,
            "num_key_value_heads": g.num_key_value_heads, "num_hidden_layers": 1, "rms_norm_eps": g.rms_norm_eps,
            "max_position_embeddings": g.max_position_embeddings, "rope_theta": theta,
            "rope_scaling": rope if rope.get("rope_type") != "default" else None,
            "vocab_size": d.config.vocab_size, "torch_dtype": "float16", **extra}


def write(folder, config, tensors, fmt):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if fmt == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_eagle1_repo(d, folder, fmt="bin"):
    """SafeAILab EAGLE-1 layout: fc (+bias), layers.0.* without input_layernorm, embed_tokens."""
    sd = dict(d.state_dict())
    sd["embed_tokens.weight"] = torch.randn(d.config.vocab_size, d.config.hidden_size)
    return write(folder, llama_fields(d, bias=d.config.fc_bias), sd, fmt)


def write_eagle3(d, folder, layout, aux_ids=None, fmt="safetensors"):
    sd = dict(d.state_dict())
    cfg = llama_fields(d, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=d.config.draft_vocab_size)
    if layout == "sglang":  # SpecForge / EAGLE repo: midlayer.*, SGLang aux ids (output of layer k)
        sd["embed_tokens.weight"] = torch.randn(d.config.vocab_size, d.config.hidden_size)
        if aux_ids is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    else:  # vLLM / modelopt: layers.0.*, HF-index aux ids at top level, no t2d
        sd = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v for k, v in sd.items()}
        del sd["t2d"]
        if aux_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = aux_ids
    return write(folder, cfg, sd, fmt)


def same_outputs(a, b, target):
    torch.manual_seed(5)
    ids = torch.randint(3, 380, (2, 7))
    hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    assert a.feature_layers == b.feature_layers
    pos = torch.arange(7)[None].expand(2, 7) + 100
    mask = ttt_mask(7, 0, torch.float32, "cpu")
    ya = a.logits(a(ids, a.fuse([hs[i] for i in a.feature_layers]), pos, mask))
    yb = b.logits(b(ids, b.fuse([hs[i] for i in b.feature_layers]), pos, mask))
    torch.testing.assert_close(ya, yb, atol=0, rtol=0)


def same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("fc_bias", [True, False])
def test_import_eagle1_repo_layout(target, tmp_path, fmt, fc_bias):
    native = randomize(Eagle1Drafter.for_target(target, fc_bias=fc_bias))
    src = write_eagle1_repo(native, tmp_path / "ref", fmt)
    got = import_eagle(src, target=target)
    assert isinstance(got, Eagle1Drafter) and got.config.fc_bias == fc_bias
    assert got.rotary.rope_type == "llama3"
    same_tensors(native, got)
    same_outputs(native, got, target)
    # and it round-trips through the native format
    got.save_pretrained(tmp_path / "native")
    same_tensors(native, Eagle1Drafter.from_pretrained(tmp_path / "native", target=target))


@pytest.mark.parametrize("layout,fmt", [("sglang", "safetensors"), ("sglang", "bin"), ("vllm", "safetensors")])
def test_import_eagle3_layouts(target, tmp_path, layout, fmt):
    native = randomize(Eagle3Drafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 3, 5]))
    native.set_draft_vocab(torch.randperm(384)[:100])
    ids = [0, 2, 4] if layout == "sglang" else [1, 3, 5]  # the same HF indices in each convention
    src = write_eagle3(native, tmp_path / "ref", layout, aux_ids=ids, fmt=fmt)
    got = import_eagle(src, target=target)
    assert isinstance(got, Eagle3Drafter)
    assert got.feature_layers == [1, 3, 5]
    assert got.metadata["imported"]["layout"] == f"eagle3-{layout}"
    same_tensors(native, got)
    same_outputs(native, got, target)


def test_import_eagle3_default_aux_layers_need_the_target(target, tmp_path):
    native = randomize(Eagle3Drafter.for_target(target, draft_vocab_size=100))
    src = write_eagle3(native, tmp_path / "ref", "sglang", aux_ids=None)
    with pytest.raises(HeadsError, match="aux"):
        import_eagle(src)
    assert import_eagle(src, target=target).feature_layers == default_aux_layers(6) == native.feature_layers
    assert import_eagle(src, aux_layers=[0, 1, 2]).feature_layers == [0, 1, 2]
    assert import_eagle(src, target=target, aux_convention="hf").feature_layers == native.feature_layers


def test_import_refuses_mismatched_shapes_naming_tensor_and_shapes(target, tmp_path):
    native = randomize(Eagle3Drafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 3, 5]))
    src = write_eagle3(native, tmp_path / "ref", "vllm", aux_ids=[1, 3, 5])
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 96  # config and tensors disagree
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadsError, match=r"'layers\.0\.mlp\.down_proj\.weight' has shape \(64, 128\).*needs \(64, 96\)"):
        import_eagle(src)


def test_import_refuses_mismatched_target_naming_both_values(target, tmp_path):
    native = randomize(Eagle1Drafter.for_target(target))
    src = write_eagle1_repo(native, tmp_path / "ref")
    other, _ = tiny_target("llama", vocab_size=384, hidden_size=32, intermediate_size=64)
    with pytest.raises((HeadsError, TargetError), match=r"hidden_size=64.*hidden_size=32"):
        import_eagle(src, target=other)


def test_import_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": Evil()}, f)
    with pytest.raises(HeadsError, match="weights_only"):
        import_eagle(folder)


def test_import_refuses_inconsistent_draft_vocab(target, tmp_path):
    native = randomize(Eagle3Drafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 3, 5]))
    sd = dict(native.state_dict())
    sd["t2d"] = sd["t2d"].roll(1)
    cfg = llama_fields(native, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=100)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}
    src = write(tmp_path / "ref", cfg, sd, "safetensors")
    with pytest.raises(HeadsError, match="d2t and t2d disagree"):
        import_eagle(src)


def test_not_an_eagle_checkpoint(tmp_path):
    src = write(tmp_path / "m", {"hidden_size": 64}, {"blocks.0.layers.0.weight": torch.zeros(2, 2)}, "safetensors")
    with pytest.raises(HeadsError, match="not an EAGLE checkpoint"):
        import_eagle(src)
