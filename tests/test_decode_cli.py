import pytest
import torch

from headway.cli import main
from headway.decode import Speculator
from headway.heads import Eagle3Drafter, HeadsError, MedusaHeads
from headway.target import TargetError, load_target
from headway.testing import tiny_target


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, llama_dir):
    model, _ = load_target(str(llama_dir))
    torch.manual_seed(0)
    return Eagle3Drafter.for_target(model, draft_vocab_size=128).save_pretrained(
        tmp_path_factory.mktemp("h") / "eagle3")


def test_generate_cli_prints_text_and_stats(capsys, llama_dir, heads_dir):
    model, tok = load_target(str(llama_dir))
    prompt = "def foo(x):\n    return"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
    rc = main(["generate", "--target", str(llama_dir), "--heads", str(heads_dir), "--prompt", prompt,
               "--max-new-tokens", "10", "--tree", "dynamic-4-3-10"])
    assert rc == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == tok.decode(ref)
    assert "tau" in out.err and "tok/s" in out.err and "Eagle3Drafter" in out.err and "linear kernel: " in out.err


def test_generate_cli_stream(capsys, llama_dir, heads_dir):
    rc = main(["generate", "--target", str(llama_dir), "--heads", str(heads_dir), "--prompt", "import os",
               "--max-new-tokens", "8", "--stream"])
    assert rc == 0
    out = capsys.readouterr()
    assert out.out.startswith("") and len(out.out.strip()) > 0 and "tau" in out.err


def test_generate_cli_errors_are_one_line(capsys, llama_dir, heads_dir):
    assert main(["generate", "--target", "/no/such/target", "--heads", str(heads_dir), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("headway generate: error:")
    assert main(["generate", "--target", str(llama_dir), "--heads", str(heads_dir), "--tree", "bogus",
                 "--prompt", "x"]) == 2
    assert "unknown tree" in capsys.readouterr().err


def test_heads_for_another_target_are_refused(tmp_path):
    small, _ = tiny_target("llama")
    other, _ = tiny_target("llama", hidden_size=96, vocab_size=384)
    path = MedusaHeads.for_target(other, num_heads=2).save_pretrained(tmp_path / "m")
    with pytest.raises((HeadsError, TargetError), match="hidden_size=96.*hidden_size=64"):
        Speculator.from_pretrained(small, path, tokenizer=object())


def test_missing_target_path_is_a_clear_error():
    with pytest.raises(TargetError, match="^target not found: no such folder '/definitely/not/here'$"):
        load_target("/definitely/not/here")


@pytest.mark.parametrize("bars", ["", "0"])
def test_generate_stdout_holds_only_the_text(llama_dir, heads_dir, tmp_path, bars):
    """A fresh process, as a user runs it: no "Loading weights" bar on either stream, unless the
    user asks for the libraries' bars back with HF_HUB_DISABLE_PROGRESS_BARS=0."""
    from train_utils import run_cli

    model, tok = load_target(str(llama_dir))
    prompt = "import os"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": bars} if bars else {}
    r = run_cli(["generate", "--target", str(llama_dir), "--heads", str(heads_dir), "--prompt", prompt,
                 "--max-new-tokens", "6"], tmp_path, extra_env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.rstrip("\n") == tok.decode(ref)
    if bars:  # the bar this test guards against does exist
        assert "Loading weights" in r.stderr
    else:
        assert "Loading weights" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("flag,expected", [([], True), (["--no-calibrate"], False)])
def test_generate_cli_passes_the_calibration_switch(capsys, llama_dir, heads_dir, monkeypatch, flag, expected):
    seen = []
    real = Speculator.from_pretrained.__func__

    def spy(cls, *a, **kw):
        seen.append(kw.get("calibrate"))
        return real(cls, *a, **kw)

    monkeypatch.setattr(Speculator, "from_pretrained", classmethod(spy))
    rc = main(["generate", "--target", str(llama_dir), "--heads", str(heads_dir), "--prompt", "import os",
               "--max-new-tokens", "4", *flag])
    assert rc == 0 and seen == [expected]
    capsys.readouterr()


@pytest.mark.parametrize("kind", ["peagle", "dspark"])
def test_generate_cli_drafts_with_peagle_and_dspark_heads(capsys, llama_dir, tmp_path, kind):
    from headway.heads import DFlashDrafter, PEagleDrafter, load_heads

    model, tok = load_target(str(llama_dir))
    torch.manual_seed(0)
    heads = PEagleDrafter.for_target(model, draft_vocab_size=128, num_depths=3) if kind == "peagle" else \
        DFlashDrafter.for_target(model, mask_token_id=3, block_size=4, markov_rank=4, confidence_head=True)
    folder = heads.save_pretrained(tmp_path / kind)
    assert type(load_heads(str(folder), target=model)) is type(heads)
    prompt = "def foo(x):\n    return"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
    assert main(["generate", "--target", str(llama_dir), "--heads", str(folder), "--prompt", prompt,
                 "--max-new-tokens", "10"]) == 0
    out = capsys.readouterr()
    assert out.out.rstrip("\n") == tok.decode(ref) and type(heads).__name__ in out.err
