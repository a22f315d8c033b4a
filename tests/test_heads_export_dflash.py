"""DFlash drafters out and back in: the published reference layout and the speculators layout
(names, shapes, layer numbering), refusals, a hand-written reference checkpoint imported, and the
imported drafter drafting exactly what the original does."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.heads import DFlashDrafter, HeadsError, load_heads
from headway.heads.export import ExportError, export_heads
from headway.heads.importers import detect_format, import_heads
from headway.testing import tiny_target

H, V, L = 64, 384, 6


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=L)
    return model


def drafter(target, vocab=None, **kw):
    torch.manual_seed(2)
    d = DFlashDrafter.for_target(target, mask_token_id=5, block_size=6, num_layers=2, aux_layers=[1, 3, 5],
                                 draft_vocab=vocab, **kw)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return d


def read(out: Path):
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


def same_drafts(a, b, target):
    """Both drafters give the same block for the same context."""
    ids = torch.arange(10, 30)[None]
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        out = []
        for d in (a, b):
            d.attach(target).eval()
            ctx = d.context_kv(d.fuse([hs[i][:, :12] for i in d.feature_layers]), torch.arange(12)[None])
            out.append(d.logits(d.block_outputs(ids[0, 12:13], torch.tensor([12]), ctx)))
    torch.testing.assert_close(out[0], out[1])


@pytest.mark.parametrize("vocab", [None, torch.arange(40, 140)])
def test_reference_layout_round_trip(target, tmp_path, vocab):
    d = drafter(target, vocab)
    out = export_heads(d.save_pretrained(tmp_path / "h"), "vllm", tmp_path / "out")
    cfg, t = read(out)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == L and cfg["block_size"] == 6
    assert cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 2, 4], "block_size": 6}
    assert cfg["layer_types"] == ["full_attention"] * 2
    assert ("lm_head.weight" in t) == (vocab is not None) and "embed_tokens.weight" not in t
    assert t["fc.weight"].shape == (H, 3 * H) and t["layers.1.self_attn.k_norm.weight"].shape == (16,)
    sd = d.state_dict()
    assert set(t) == set(sd) and all(torch.equal(t[k], sd[k]) for k in t)
    assert detect_format(out) == "dflash"
    back = import_heads(out, target=target)
    assert isinstance(back, DFlashDrafter) and back.config.aux_layers == [1, 3, 5]
    assert back.config.draft_vocab_size == (None if vocab is None else 100) and back.config.mask_token_id == 5
    same_drafts(d, back, target)
    assert "DFLASH" in (out / "README.md").read_text()


def test_speculators_layout_round_trip(target, tmp_path):
    d = drafter(target, torch.arange(40, 140))
    d.target_info.name_or_path = "someorg/tiny-llama"  # the speculators verifier
    out = export_heads(d.save_pretrained(tmp_path / "h"), "speculators", tmp_path / "out")
    cfg, t = read(out)
    assert cfg["speculators_model_type"] == "dflash" and cfg["speculators_config"]["algorithm"] == "dflash"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3, 5]  # HF indices: vLLM subtracts one for the model
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2 and cfg["draft_vocab_size"] == 100
    assert cfg["mask_token_id"] == 5 and cfg["block_size"] == 6 and cfg["target_hidden_size"] == H
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "someorg/tiny-llama"
    assert t["lm_head.weight"].shape == (100, H) and t["d2t"].dtype == torch.int64
    back = import_heads(out, target=target)
    assert back.config == d.config
    same_drafts(d, back, target)


def test_refusals_name_the_reason(target, tmp_path):
    plain = drafter(target, qk_norm=False).save_pretrained(tmp_path / "plain")
    with pytest.raises(ExportError, match="qk_norm=false"):
        export_heads(plain, "vllm", tmp_path / "o1")
    torch.manual_seed(0)
    deep = DFlashDrafter.for_target(target, mask_token_id=5, aux_layers=[2, L]).save_pretrained(tmp_path / "deep")
    with pytest.raises(ExportError, match=rf"aux layers \[{L}\].*post-norm"):
        export_heads(deep, "speculators", tmp_path / "o2")
    with pytest.raises(ExportError, match="cannot be exported to sglang"):
        export_heads(deep, "sglang", tmp_path / "o3")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


def test_a_published_reference_checkpoint_imports(target, tmp_path):
    """The layout the published drafters ship (Qwen3 config + dflash_config, no embeddings or lm_head,
    bf16 tensors), written here by hand."""
    d = drafter(target)
    folder = tmp_path / "published"
    folder.mkdir()
    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "model_type": "qwen3", "hidden_size": H, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 512, "vocab_size": V, "block_size": 6,
              "num_target_layers": L, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 2, 4]},
              "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16) for k, v in d.state_dict().items()}, str(folder / "model.safetensors"))
    back = import_heads(folder, target=target)
    assert back.config.aux_layers == [1, 3, 5] and back.config.block_size == 6 and back.config.num_layers == 2
    assert back.metadata["imported"]["layout"] == "dflash-reference"
    sd = d.state_dict()
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, sd[k].to(torch.bfloat16).float())
    del config["block_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match="lacks block_size"):
        import_heads(folder)
    config["block_size"] = 6
    config["num_hidden_layers"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsError, match=r"missing \['layers.2"):
        import_heads(folder)


def test_cli_export_then_import_then_decode(target, tmp_path, capsys):
    from headway.decode import Speculator
    from headway.testing import save_tiny_target

    folder = save_tiny_target(tmp_path / "target", num_hidden_layers=L)
    from headway.target import load_target

    model, tok = load_target(str(folder))
    heads = drafter(model).save_pretrained(tmp_path / "h")
    assert main(["export", str(heads), "--format", "speculators", "--out", str(tmp_path / "spec")]) == 0
    assert main(["import", str(tmp_path / "spec"), "--out", str(tmp_path / "back"), "--target", str(folder)]) == 0
    back = load_heads(tmp_path / "back", target=model)
    ids = tok("def add(a, b):\n    return")["input_ids"]
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=2)[0, len(ids):]
    assert Speculator(model, tok, back, tree="chain-5").generate(ids, max_new_tokens=12).ids == ref.tolist()
