import pytest
import torch
from transformers import T5Config, T5Model

from headway.target import TargetError, TargetInfo, load_target
from headway.testing import save_tiny_target, tiny_tokenizer


def test_load_target_is_frozen_eval_and_on_device(llama_dir):
    model, tok = load_target(str(llama_dir), dtype="float32", device="cpu")
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32 and len(tok) == model.config.vocab_size


def test_load_target_dtype(llama_dir):
    model, _ = load_target(str(llama_dir), dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_every_fixture_architecture_loads(target_dirs):
    for arch, path in target_dirs.items():
        model, tok = load_target(str(path))
        ids = tok("def f(x): return x", return_tensors="pt").input_ids
        assert model(ids).logits.shape[-1] == len(tok), arch


def test_missing_path(tmp_path):
    with pytest.raises(TargetError, match=f"^target not found: no such folder '{tmp_path / 'nope'}'$"):
        load_target(str(tmp_path / "nope"))


def test_not_a_causal_lm(tmp_path):
    T5Model(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=100)).save_pretrained(
        tmp_path / "t5")  # an encoder-decoder: AutoModelForCausalLM has no class for it
    with pytest.raises(TargetError, match="not a causal LM"):
        load_target(str(tmp_path / "t5"))


def test_tokenizer_vocab_mismatch(tmp_path):
    path = save_tiny_target(tmp_path / "t", "llama", vocab_size=384)
    tiny_tokenizer(512).save_pretrained(path)  # a tokenizer with more tokens than the embedding
    with pytest.raises(TargetError, match="512 tokens.*384"):
        load_target(str(path))


def test_target_info_mismatch_names_both_values():
    a = TargetInfo("a", None, 64, 384, 2, "LlamaForCausalLM")
    b = TargetInfo("b", None, 64, 500, 2, "LlamaForCausalLM")
    with pytest.raises(TargetError, match="vocab_size=384.*vocab_size=500"):
        a.check_matches(b)


# -- the one resolver: a local folder or a Hub repo id ------------------------------------------
def test_resolve_folder_local_hub_cache_and_errors(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from headway.heads import HeadsError
    from headway.target import resolve_folder

    local = tmp_path / "heads"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert resolve_folder(str(local)) == local
    snap = tmp_path / "hub" / "models--someorg--thing" / "snapshots" / ("b" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("b" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_folder("someorg/thing", allow_patterns=["*.json"]) == snap
    with pytest.raises(HeadsError, match="^heads checkpoint not found: no such folder '/nope'$"):
        resolve_folder("/nope", what="heads checkpoint", error=HeadsError)
    with pytest.raises(TargetError, match="^checkpoint not found: no such folder 'someorg/absent', and as a Hub "
                                          "repo id it is not in the local Hub cache"):
        resolve_folder("someorg/absent")


@pytest.mark.parametrize("argv", [
    ["distill", "prompts.jsonl"], ["train", "data=runs/distilled"], ["bench", "--heads", "h"],
    ["tune", "--heads", "h"], ["generate", "--heads", "h", "--prompt", "x"], ["chat", "--heads", "h"],
    ["prompts", "--num", "4"], ["tokenize", "rows.jsonl"],
])
def test_a_command_that_runs_a_target_needs_one_named(argv, monkeypatch, capsys):
    """No command quietly runs the demo target: without --target it is one line saying what to pass,
    before anything is read, built or loaded."""
    import headway.target
    from headway.cli import main

    monkeypatch.setattr(headway.target, "resolve_target_path", lambda *a: pytest.fail("resolved a target"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"headway {argv[0]}: error: no target model given; pass "
                                                   "--target MODEL"), err
    assert "a Hub id" in err and "demo" in err


def test_features_may_leave_the_target_to_the_dataset_and_the_demo_recipes_name_theirs():
    from pathlib import Path

    from headway.config import load_config
    from headway.data.configs import DistillConfig, FeaturesConfig
    from headway.train.config import TrainConfig

    assert load_config(FeaturesConfig, None, {"dataset": "runs/distilled"}).target is None
    configs = Path(__file__).resolve().parents[1] / "configs"
    assert load_config(DistillConfig, configs / "demo" / "distill.yaml").target == "demo"
    for kind in ("medusa", "eagle1", "eagle3", "dflash"):
        assert load_config(TrainConfig, configs / "demo" / f"{kind}.yaml").target == "demo"


def test_a_hub_id_not_found_says_so_with_what_the_hub_said(tmp_path, monkeypatch):
    """A name that is both a missing folder and a Hub id: both in one line (#46)."""
    from huggingface_hub import constants

    from headway.target import missing_message

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    error = OSError("404 Client Error: Repository Not Found\nsecond line")
    assert missing_message("org/x", "heads checkpoint", error, "v2") == (
        "heads checkpoint not found: no such folder 'org/x', and as a Hub repo id at revision 'v2': 404 Client "
        "Error: Repository Not Found")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert missing_message("org/x", "target", error).endswith("it is not in the local Hub cache (HF_HUB_OFFLINE is "
                                                              "set: the Hub was not asked)")
    (tmp_path / "models--org--x").mkdir()  # cached, but not that revision: what the Hub library said
    assert missing_message("org/x", "target", error, "v2").endswith("at revision 'v2': 404 Client Error: Repository "
                                                                    "Not Found")
