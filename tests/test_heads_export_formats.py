"""`headway export`: engine folders for vLLM / SGLang / TensorRT-LLM / speculators, checked against each
engine's names and shapes; refusals; EAGLE-3 aux-layer translation; atomic writes."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.heads import Eagle1Drafter, Eagle3Drafter, MedusaHeads
from headway.heads.export import EXPORTERS, ExportError, check_tensors, engine_aux_layers, export_heads
from headway.testing import tiny_target

H, V, L = 64, 384, 4  # tiny llama: hidden 64, vocab 384, 4 layers, 4 heads x 16, 2 KV heads, ffn 128


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=L)
    return model


def randomized(heads):
    """Non-zero weights everywhere, so value checks mean something (Medusa starts at zero)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    return heads


def save(heads, path):
    return heads.save_pretrained(path)


def read(out: Path, weights: str = "model.safetensors"):
    return json.loads((out / "config.json").read_text()), load_file(str(out / weights))


def shapes(tensors):
    return {k: tuple(v.shape) for k, v in tensors.items()}


# -- Medusa ----------------------------------------------------------------------------------------
def test_medusa_vllm_config_and_tensors(target, tmp_path):
    heads = randomized(MedusaHeads.for_target(target, num_heads=3, num_layers=2))
    out = export_heads(save(heads, tmp_path / "h"), "vllm", tmp_path / "out")
    cfg, t = read(out)
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, H, V)
    assert cfg["medusa_fc_bias"] is True
    # vLLM renames every top-level key with "num" + "heads"/"layers": only ours may exist
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    want = {f"lm_heads.{h}.weight": (V, H) for h in range(3)}
    want |= {f"blocks.{h}.layers.{l}.{p}": (H, H) if p == "weight" else (H,)
             for h in range(3) for l in range(2) for p in ("weight", "bias")}
    assert shapes(t) == want
    sd = heads.state_dict()
    assert all(torch.equal(t[k], sd[k]) for k in t)
    assert (out / "README.md").read_text().count("medusa") >= 1


def test_medusa_without_bias_says_so(target, tmp_path):
    heads = MedusaHeads.for_target(target, num_heads=2, bias=False)
    cfg, t = read(export_heads(heads, "vllm", tmp_path / "out"))
    assert cfg["medusa_fc_bias"] is False
    assert not [k for k in t if k.endswith(".bias")]


def test_medusa_shared_lm_head_needs_the_target(target, tmp_path):
    heads = randomized(MedusaHeads.for_target(target, num_heads=2, own_lm_head=False))
    src = save(heads, tmp_path / "h")
    for fmt in ("vllm", "trtllm"):
        with pytest.raises(ExportError, match="share the target's lm_head.*--target"):
            export_heads(src, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    _, t = read(export_heads(src, "vllm", tmp_path / "vllm", target=target))
    lm = target.get_output_embeddings().weight
    assert all(torch.equal(t[f"lm_heads.{h}.weight"], lm) for h in range(2))


def test_medusa_shared_lm_head_refuses_a_different_target(tmp_path):
    a, _ = tiny_target("llama")
    b, _ = tiny_target("llama", hidden_size=32, intermediate_size=64)
    heads = MedusaHeads.for_target(a, num_heads=2, own_lm_head=False)
    with pytest.raises(Exception, match="hidden_size=64.*hidden_size=32"):
        export_heads(heads, "vllm", tmp_path / "out", target=b)


def test_medusa_trtllm_is_the_faster_decoding_layout(target, tmp_path):
    heads = randomized(MedusaHeads.for_target(target, num_heads=3, num_layers=1))
    out = export_heads(save(heads, tmp_path / "h"), "trtllm", tmp_path / "out")
    cfg, t = read(out, "medusa_lm_head.safetensors")
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"]) == (3, 1)
    assert shapes(t) == {**{f"{h}.0.linear.weight": (H, H) for h in range(3)},
                         **{f"{h}.0.linear.bias": (H,) for h in range(3)},
                         **{f"{h}.1.weight": (V, H) for h in range(3)}}
    assert torch.equal(t["2.0.linear.weight"], heads.blocks[2].layers[0].weight)
    assert torch.equal(t["1.1.weight"], heads.lm_heads[1].weight)
    assert "--num_medusa_heads 3" in (out / "README.md").read_text()
    # the importer for the reference format reads it back as the same heads
    from headway.heads.importers import import_heads

    back = import_heads(out, target=target)
    x = torch.randn(5, H)
    torch.testing.assert_close(back(x), heads(x))


def test_medusa_trtllm_writes_zero_biases_when_there_are_none(target, tmp_path):
    heads = MedusaHeads.for_target(target, num_heads=2, bias=False)
    _, t = read(export_heads(heads, "trtllm", tmp_path / "out"), "medusa_lm_head.safetensors")
    assert torch.count_nonzero(t["0.0.linear.bias"]) == 0 and "1.0.linear.bias" in t


def vocab_ids(n=100, seed=3):
    return torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:n]


def test_medusa_reduced_vocab_is_vllms_truncated_vocab(target, tmp_path):
    ids = vocab_ids()
    heads = randomized(MedusaHeads.for_target(target, num_heads=3, num_layers=1, draft_vocab=ids))
    cfg, t = read(export_heads(save(heads, tmp_path / "h"), "vllm", tmp_path / "out"))
    assert (cfg["vocab_size"], cfg["truncated_vocab_size"]) == (V, 100)
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    assert t["token_map"].dtype == torch.int64 and torch.equal(t["token_map"], ids.sort().values)
    assert {k: s for k, s in shapes(t).items() if k.startswith("lm_heads.")} == {f"lm_heads.{h}.weight": (100, H)
                                                                                 for h in range(3)}
    assert "d2t" not in t and "t2d" not in t
    # what vLLM's Medusa.compute_logits does: scatter the head's logits to token_map, -inf elsewhere
    x = torch.randn(5, H)
    blocks = [heads.blocks[h](x) for h in range(3)]
    for h in range(3):
        full = torch.full((5, V), float("-inf"))
        full[:, t["token_map"]] = blocks[h] @ t[f"lm_heads.{h}.weight"].T
        assert torch.equal(full.argmax(-1), heads.to_target_ids(heads(x)[h].argmax(-1)))


def test_medusa_reduced_vocab_is_refused_for_trtllm(target, tmp_path):
    heads = MedusaHeads.for_target(target, num_heads=2, draft_vocab=vocab_ids())
    with pytest.raises(ExportError, match="reduced vocabulary.*TensorRT-LLM.*--format vllm") as e:
        export_heads(heads, "trtllm", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


# -- EAGLE-1 ---------------------------------------------------------------------------------------
def eagle1_layer_names(prefix="layers.0."):
    return {prefix + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight", "post_attention_layernorm.weight")}


def test_eagle1_vllm_is_a_one_layer_llama(target, tmp_path):
    heads = randomized(Eagle1Drafter.for_target(target))
    out = export_heads(save(heads, tmp_path / "h"), "vllm", tmp_path / "out")
    cfg, t = read(out)
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert set(t) == {"fc.weight"} | eagle1_layer_names()  # no input_layernorm, no norm, no lm_head
    assert t["fc.weight"].shape == (H, 2 * H)
    assert t["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, H)
    assert torch.equal(t["fc.weight"], heads.fc.weight)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(out)  # a valid Llama config for transformers
    assert (hf.head_dim, hf.num_key_value_heads, hf.rope_parameters["rope_theta"]) == (16, 2, 10000.0)


def test_eagle1_fc_bias_is_refused_for_vllm_with_the_reason(target, tmp_path):
    heads = Eagle1Drafter.for_target(target, fc_bias=True)
    with pytest.raises(ExportError, match="bias.*vLLM.*fc_bias=false"):
        export_heads(heads, "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fc_bias", [False, True])
def test_eagle1_sglang_always_has_an_fc_bias(target, tmp_path, fc_bias):
    heads = randomized(Eagle1Drafter.for_target(target, fc_bias=fc_bias))
    cfg, t = read(export_heads(heads, "sglang", tmp_path / "out"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    assert set(t) == {"fc.weight", "fc.bias"} | eagle1_layer_names()
    want = heads.fc.bias if fc_bias else torch.zeros(H)
    assert torch.equal(t["fc.bias"], want)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle1_draft_vocab_is_dropped_and_the_export_imports_back(target, tmp_path, fmt):
    """Engines draft EAGLE-1 over the full vocabulary with the target's lm_head: the export is the
    full-vocabulary drafter (no d2t / t2d), and reads back as exactly that."""
    from headway.heads.importers import import_heads

    heads = randomized(Eagle1Drafter.for_target(target, draft_vocab=vocab_ids()))
    out = export_heads(save(heads, tmp_path / "h"), fmt, tmp_path / "out")
    cfg, t = read(out)
    assert cfg["vocab_size"] == V and "draft_vocab_size" not in cfg
    assert set(t) == {"fc.weight"} | ({"fc.bias"} if fmt == "sglang" else set()) | eagle1_layer_names()
    assert "Draft vocabulary" in (out / "README.md").read_text()
    back = import_heads(out, target=target)
    assert isinstance(back, Eagle1Drafter) and not back.has_draft_vocab
    sd = back.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in heads.state_dict().items() if k not in ("d2t", "t2d", "fc.bias"))
    h = torch.randn(2, 3, H)
    torch.testing.assert_close(back.eval().logits(h), heads.eval().full_logits(h))


# -- EAGLE-3 ---------------------------------------------------------------------------------------
@pytest.fixture
def eagle3(target):
    heads = randomized(Eagle3Drafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 2, 3]))
    heads.set_draft_vocab(torch.arange(0, 200, 2))
    return heads


@pytest.mark.parametrize("fmt,ids,top_level", [("vllm", [1, 2, 3], True), ("sglang", [0, 1, 2], False)])
def test_eagle3_config_tensors_and_aux_layers_per_engine(eagle3, tmp_path, fmt, ids, top_level):
    out = export_heads(save(eagle3, tmp_path / "h"), fmt, tmp_path / "out")
    cfg, t = read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (100, H, V)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert cfg.get("eagle_aux_hidden_state_layer_ids") == (ids if top_level else None)
    assert cfg["headway"]["aux_layers_hf_index"] == [1, 2, 3]
    names = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight",
             "lm_head.weight", "d2t", "t2d"} | eagle1_layer_names("midlayer.")
    assert set(t) == names
    assert t["fc.weight"].shape == (H, 3 * H) and t["midlayer.self_attn.q_proj.weight"].shape == (64, 2 * H)
    assert t["lm_head.weight"].shape == (100, H)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and t["t2d"].shape == (V,)
    assert torch.equal(torch.arange(100) + t["d2t"], torch.arange(0, 200, 2))  # draft id -> target id


def test_eagle3_trtllm_is_the_reference_layout_with_output_numbered_layers(eagle3, tmp_path):
    """TensorRT-LLM's Eagle3ForCausalLM (PyTorch backend) reads midlayer.*, fc, norm, lm_head, d2t;
    its eagle3_layers_to_capture number a layer's output, as SGLang: HF index - 1."""
    out = export_heads(save(eagle3, tmp_path / "h"), "trtllm", tmp_path / "out")
    cfg, t = read(out)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["vocab_size"]) == (100, H, V)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (H, 4, 2)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg  # a top-level key would mean vLLM's numbering
    # flags that switch Eagle3DraftModel to other variants stay unset
    assert not {"bias", "norm_output", "fc_norm"} & set(cfg)
    assert not {"norm_before_fc", "eh_proj_before_attn", "return_hidden_post_norm"} & set(cfg["eagle_config"])
    assert cfg["headway"]["aux_layers_hf_index"] == [1, 2, 3] and cfg["headway"]["format"] == "trtllm"
    assert shapes(t) == {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (100, H), "d2t": (100,),
                         "t2d": (V,), "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
                         "midlayer.self_attn.q_proj.weight": (64, 2 * H),
                         "midlayer.self_attn.k_proj.weight": (32, 2 * H),
                         "midlayer.self_attn.v_proj.weight": (32, 2 * H), "midlayer.self_attn.o_proj.weight": (H, 64),
                         "midlayer.mlp.gate_proj.weight": (128, H), "midlayer.mlp.up_proj.weight": (128, H),
                         "midlayer.mlp.down_proj.weight": (H, 128), "midlayer.post_attention_layernorm.weight": (H,)}
    assert t["d2t"].dtype == torch.int64 and torch.equal(torch.arange(100) + t["d2t"], torch.arange(0, 200, 2))
    assert "eagle3_layers_to_capture={0, 1, 2}" in (out / "README.md").read_text()


def test_speculators_eagle3_is_what_vllm_detects(eagle3, tmp_path):
    """The fields vLLM 0.32.0's SpeculatorsConfig validates and reads, and the speculators tensor names."""
    eagle3.target_info.name_or_path = "someorg/tiny-llama"
    out = export_heads(save(eagle3, tmp_path / "h"), "speculators", tmp_path / "out")
    cfg, t = read(out)
    spec = cfg["speculators_config"]
    assert cfg["speculators_model_type"] == "eagle3" and spec["algorithm"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": "someorg/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert (layer["hidden_size"], layer["head_dim"], layer["num_key_value_heads"]) == (H, 16, 2)
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (100, H)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's numbering: HF indices
    assert cfg["norm_before_residual"] is False  # vLLM's default for speculators is true
    assert cfg["norm_before_fc"] is False and "eagle_config" not in cfg
    names = {"fc.weight", "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight", "norm.weight",
             "lm_head.weight", "d2t", "t2d"} | eagle1_layer_names()
    assert set(t) == names and t["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * H)
    assert torch.equal(t["fc.weight"], eagle3.fc.weight) and t["d2t"].dtype == torch.int64
    assert "vllm serve" in (out / "README.md").read_text()


@pytest.mark.parametrize("kind", ["eagle1", "medusa"])
def test_speculators_refuses_kinds_vllm_has_no_speculators_type_for(target, tmp_path, kind):
    heads = Eagle1Drafter.for_target(target) if kind == "eagle1" else MedusaHeads.for_target(target)
    with pytest.raises(ExportError, match=f"{kind} heads have no speculators form.*--format vllm"):
        export_heads(heads, "speculators", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_speculators_needs_a_target_to_name_as_verifier(eagle3, tmp_path):
    eagle3.target_info = None
    with pytest.raises(ExportError, match="records no target.*verifier"):
        export_heads(eagle3, "speculators", tmp_path / "out")


def test_aux_layer_translation_and_refusals():
    assert engine_aux_layers([2, 4, 5], 8, "vllm") == [2, 4, 5]
    assert engine_aux_layers([2, 4, 5], 8, "sglang") == [1, 3, 4]
    assert engine_aux_layers([2, 4, 5], 8, "trtllm") == [1, 3, 4]
    with pytest.raises(ExportError, match="after the final norm"):
        engine_aux_layers([0, 1, 2], 2, "vllm")  # index L = post-norm in HF, pre-norm in the engines
    with pytest.raises(ExportError, match="distinct"):
        engine_aux_layers([1, 1, 2], 4, "vllm")


def test_eagle3_with_the_last_layer_is_refused(target, tmp_path):
    heads = Eagle3Drafter.for_target(target, aux_layers=[1, 2, L])
    heads.target_info.name_or_path = "someorg/tiny-llama"  # the speculators verifier
    for fmt in ("vllm", "sglang", "trtllm", "speculators"):
        with pytest.raises(ExportError, match=f"aux layer {L}"):
            export_heads(heads, fmt, tmp_path / fmt)


def test_kind_and_format_combinations(target, tmp_path):
    with pytest.raises(ExportError, match="eagle1 heads cannot be exported to trtllm"):
        export_heads(Eagle1Drafter.for_target(target), "trtllm", tmp_path / "a")
    with pytest.raises(ExportError, match="medusa heads cannot be exported to sglang.*vllm, trtllm$"):
        export_heads(MedusaHeads.for_target(target), "sglang", tmp_path / "b")
    with pytest.raises(ExportError, match="unknown export format"):
        export_heads(MedusaHeads.for_target(target), "onnx", tmp_path / "c")


# -- bad input, spec checks, atomic writes ---------------------------------------------------------
def corrupt(src: Path, edit):
    t = load_file(str(src / "model.safetensors"))
    edit(t)
    save_file(t, str(src / "model.safetensors"))
    return src


def test_missing_tensor_is_a_clear_error(target, tmp_path):
    src = corrupt(save(Eagle1Drafter.for_target(target), tmp_path / "h"),
                  lambda t: t.pop("layers.0.mlp.down_proj.weight"))
    with pytest.raises(ExportError, match="missing \\['layers.0.mlp.down_proj.weight'\\]"):
        export_heads(src, "vllm", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]  # nothing written, no temp folders


def test_misshapen_tensor_is_a_clear_error(target, tmp_path):
    def edit(t):
        t["blocks.1.layers.0.weight"] = torch.zeros(H, H - 1)

    src = corrupt(save(MedusaHeads.for_target(target, num_heads=2), tmp_path / "h"), edit)
    with pytest.raises(ExportError, match="'blocks.1.layers.0.weight' has shape \\(64, 63\\), expected \\(64, 64\\)"):
        export_heads(src, "trtllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_engine_spec_catches_an_exporter_that_drops_a_tensor(target, tmp_path, monkeypatch):
    real = EXPORTERS[("eagle1", "sglang")]

    def buggy(cfg, t, lm, dtype):
        ex = real(cfg, t, lm, dtype)
        del ex.tensors["fc.bias"]
        return ex

    monkeypatch.setitem(EXPORTERS, ("eagle1", "sglang"), buggy)
    with pytest.raises(ExportError, match="sglang export.*missing \\['fc.bias'\\]"):
        export_heads(Eagle1Drafter.for_target(target), "sglang", tmp_path / "out")


def test_check_tensors_checks_dtype():
    spec = {"d2t": ((3,), torch.int64), "w": ((2, 2), None)}
    check_tensors({"d2t": torch.zeros(3, dtype=torch.long), "w": torch.zeros(2, 2)}, spec, "x")
    with pytest.raises(ExportError, match="'d2t' has dtype torch.int32"):
        check_tensors({"d2t": torch.zeros(3, dtype=torch.int32), "w": torch.zeros(2, 2)}, spec, "x")
    with pytest.raises(ExportError, match="floating"):
        check_tensors({"d2t": torch.zeros(3, dtype=torch.long), "w": torch.zeros(2, 2, dtype=torch.long)}, spec, "x")


def test_a_failure_mid_write_leaves_no_partial_folder(target, tmp_path, monkeypatch):
    import headway.heads.export as export

    def half_written(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    heads = MedusaHeads.for_target(target, num_heads=2)
    monkeypatch.setattr(export, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        export_heads(heads, "vllm", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    # an existing export survives a failed re-export untouched
    monkeypatch.undo()
    out = export_heads(heads, "vllm", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(export, "save_file", half_written)
    with pytest.raises(OSError):
        export_heads(MedusaHeads.for_target(target, num_heads=3), "vllm", tmp_path / "out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_reexport_replaces_the_folder(target, tmp_path):
    export_heads(MedusaHeads.for_target(target, num_heads=2), "vllm", tmp_path / "out")
    cfg, _ = read(export_heads(MedusaHeads.for_target(target, num_heads=3), "vllm", tmp_path / "out"))
    assert cfg["num_heads"] == 3 and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_dtype_cast_keeps_index_tensors(eagle3, tmp_path):
    cfg, t = read(export_heads(eagle3, "vllm", tmp_path / "out", dtype="bfloat16"))
    assert cfg["torch_dtype"] == "bfloat16" and t["fc.weight"].dtype == torch.bfloat16
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool


def test_cli_export_and_its_one_line_errors(target, tmp_path, capsys):
    src = save(Eagle1Drafter.for_target(target, fc_bias=True), tmp_path / "h")
    assert main(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "sg")]) == 0
    assert "SGLang" in capsys.readouterr().out and (tmp_path / "sg" / "model.safetensors").is_file()
    assert main(["export", str(src), "--format", "vllm", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("headway export: error:") and "fc_bias" in err and "\n" not in err


def _interop_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "checks" / "vllm_parity.py"
    spec = importlib.util.spec_from_file_location("vllm_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interop_check_needs_equal_counts_for_trained_heads_unless_given_a_tolerance():
    """The measured speculators control (aux ids one too low on a 4-layer target) moved acceptance by
    at most 0.024 per position: inside the old 0.03 gap, so the check could not fail. By default the
    counts must now be equal, which catches it; a tolerance stays available for bf16/GPU engines."""
    interop = _interop_script()
    hw = {"per_pos": [121, 67, 51], "drafts": 141, "ids": [[1, 2]]}
    right = {"metrics": {interop.METRIC: [121, 67, 51], "vllm:spec_decode_num_drafts": 141}, "seconds": 1.0}
    wrong = {"metrics": {interop.METRIC: [124, 68, 48], "vllm:spec_decode_num_drafts": 142}, "seconds": 1.0}
    for exact in (True, False):
        assert interop.compare("h", hw, {**right, "ids": hw["ids"]}, hw, 3, exact, 0.0)["acceptance_ok"]
        assert not interop.compare("h", hw, {**wrong, "ids": hw["ids"]}, hw, 3, exact, 0.0)["acceptance_ok"]
    assert interop.compare("h", hw, {**wrong, "ids": hw["ids"]}, hw, 3, False, 0.03)["acceptance_ok"]
    assert not interop.compare("h", hw, {**wrong, "ids": [[1, 3]]}, hw, 3, False, 0.03)["ids_equal"]


def test_interop_check_reads_prompts_from_a_source_in_the_targets_chat_format(tmp_path):
    """`--prompts`: chat prompts (where heads trained on chat answers accept enough for a negative control
    to show) come through the target's chat template, as distill and bench condition its answer."""
    import copy

    from headway.testing import tiny_target

    interop = _interop_script()
    _, tok = tiny_target("llama")
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"question number {i}"}) + "\n" for i in range(5)))
    got = interop.source_prompts(tok, str(src), 3)
    assert len(got) == 3
    texts = [tok.decode(ids) for ids in got]
    assert all(t.endswith("<|bos|>assistant\n") and f"user\nquestion number {i}<|eos|>" in t
               for i, t in enumerate(texts))
