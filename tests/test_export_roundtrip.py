"""Every `headway export` format reads back with `headway import` as the same heads (tensors,
config, greedy decode), and `headway push` publishes every export format (Hub API mocked)."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from headway.cli import main
from headway.heads import DFlashDrafter, Eagle1Drafter, Eagle3Drafter, HeadsError, MedusaHeads, PEagleDrafter
from headway.heads.export import EXPORTERS, ExportError, export_heads
from headway.heads.hub import HubError, push_heads
from headway.heads.importers import import_heads
from headway.testing import tiny_target

L = 4


@pytest.fixture(scope="module")
def target_and_tok():
    return tiny_target("llama", num_hidden_layers=L)


def randomized(heads, seed=1):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    heads.target_info.name_or_path = "someorg/tiny-llama"
    return heads


def make(kind: str, target, draft_vocab: bool):
    ids = torch.arange(0, 300, 3)
    if kind == "medusa":
        return randomized(MedusaHeads.for_target(target, num_heads=3, num_layers=2,
                                                 draft_vocab=ids if draft_vocab else None))
    if kind == "eagle1":
        return randomized(Eagle1Drafter.for_target(target))
    if kind == "dflash":
        return randomized(DFlashDrafter.for_target(target, mask_token_id=4, block_size=4, aux_layers=[1, 3],
                                                   draft_vocab=ids if draft_vocab else None))
    if kind == "peagle":
        heads = randomized(PEagleDrafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 2, 3], num_layers=2))
    else:
        heads = randomized(Eagle3Drafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 2, 3]))
    heads.set_draft_vocab(ids)
    return heads


# every (kind, format) headway exports, with the heads each format can carry
CASES = [("medusa", "vllm", False), ("medusa", "vllm", True), ("medusa", "trtllm", False),
         ("eagle1", "vllm", False), ("eagle1", "sglang", False),
         ("eagle3", "vllm", True), ("eagle3", "sglang", True), ("eagle3", "trtllm", True),
         ("eagle3", "speculators", True), ("dflash", "vllm", False), ("dflash", "speculators", True),
         ("peagle", "vllm", True), ("peagle", "speculators", True)]
NO_PROPOSER_YET = {"peagle"}  # #62 phase 2 adds its decoder; tests/test_export_peagle.py compares its drafts


def test_the_cases_cover_every_exporter():
    assert {(k, f) for k, f, _ in CASES} == set(EXPORTERS)


def decode(target, tok, heads):
    from headway.decode import Speculator, chain

    spec = Speculator(target, tok, heads.attach(target), tree=chain(3))
    outs = [spec.generate(p, max_new_tokens=24, temperature=0.0) for p in ("def f(x):", "import os\n", "class A")]
    return [(o.ids, o.stats.accepted_per_depth, o.stats.target_forwards) for o in outs]


@pytest.mark.parametrize("kind,fmt,draft_vocab", CASES)
def test_export_then_import_gives_the_same_heads(target_and_tok, tmp_path, kind, fmt, draft_vocab):
    target, tok = target_and_tok
    heads = make(kind, target, draft_vocab)
    out = export_heads(heads.save_pretrained(tmp_path / "h"), fmt, tmp_path / "out")
    back = import_heads(out, target=target)
    assert back.kind == kind and back.config == heads.config
    mine, theirs = heads.state_dict(), back.state_dict()
    assert set(theirs) == set(mine)  # SGLang's zero fc.bias (= none) is dropped again
    for k, v in mine.items():
        assert torch.equal(theirs[k], v), k
    if kind not in NO_PROPOSER_YET:
        assert decode(target, tok, back) == decode(target, tok, heads)  # the same heads decode alike, end to end


NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}  # speculators' defaults


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_eagle3_with_speculators_norms_exports_them_for_vllm_and_imports_back(target_and_tok, tmp_path, fmt):
    """vLLM (0.32) computes speculators' three EAGLE-3 norms, so both vLLM formats carry them (and
    input_norm for norm_before_fc) and read back as the same drafter; the engines that do not
    compute them refuse by option name and write nothing."""
    target, tok = target_and_tok
    heads = randomized(Eagle3Drafter.for_target(target, draft_vocab_size=100, aux_layers=[1, 2, 3], **NORMS))
    heads.set_draft_vocab(torch.arange(0, 300, 3))
    native = heads.save_pretrained(tmp_path / "h")
    out = export_heads(native, fmt, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in NORMS} == NORMS and cfg.get("fc_norm", False) is False
    assert load_file(str(out / "model.safetensors"))["input_norm.weight"].shape == (3 * heads.config.hidden_size,)
    back = import_heads(out, target=target)
    assert back.config == heads.config
    for k, v in heads.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert decode(target, tok, back) == decode(target, tok, heads)
    for engine in ("sglang", "trtllm"):
        with pytest.raises(ExportError, match=f"norm_before_fc.*which {engine} does not compute"):
            export_heads(native, engine, tmp_path / engine)
        assert not (tmp_path / engine).exists()


def test_import_of_a_vllm_medusa_export_keeps_the_truncated_vocab(target_and_tok, tmp_path):
    target, _ = target_and_tok
    heads = make("medusa", target, draft_vocab=True)
    back = import_heads(export_heads(heads, "vllm", tmp_path / "out"), target=target)
    assert back.has_draft_vocab and torch.equal(back.draft_token_ids(), torch.arange(0, 300, 3))
    x = torch.randn(5, target.config.hidden_size)
    assert torch.equal(back.to_target_ids(back(x).argmax(-1)), heads.to_target_ids(heads(x).argmax(-1)))


def test_import_of_a_vllm_medusa_folder_checks_its_tensors(target_and_tok, tmp_path):
    target, _ = target_and_tok
    out = export_heads(make("medusa", target, draft_vocab=True), "vllm", tmp_path / "out")
    t = load_file(str(out / "model.safetensors"))
    del t["token_map"]  # 100-row lm_heads without the map that says which tokens they are
    (out / "model.safetensors").chmod(0o644)
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(HeadsError, match="token_map is missing"):
        import_heads(out, target=target)


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "trtllm", "speculators"])
def test_eagle3_aux_layers_come_back_as_hf_indices_whatever_the_engine_numbering(target_and_tok, tmp_path, fmt):
    target, _ = target_and_tok
    heads = make("eagle3", target, True)
    out = export_heads(heads, fmt, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("headway")  # a reader without headway's block goes by the engine's own convention
    (out / "config.json").chmod(0o644)
    (out / "config.json").write_text(json.dumps(cfg))
    assert import_heads(out, target=target).config.aux_layers == [1, 2, 3]


# -- push ------------------------------------------------------------------------------------------
@pytest.fixture
def captured(monkeypatch):
    pushed = {}

    def fake_push(folder, repo_id, **kw):
        pushed["files"] = sorted(p.name for p in folder.iterdir())
        pushed["card"] = (folder / "README.md").read_text()
        return f"https://hub/{repo_id}"

    monkeypatch.setattr("headway.heads.hub.push_folder", fake_push)
    return pushed


@pytest.mark.parametrize("kind,fmt,draft_vocab", CASES)
def test_push_accepts_every_export_format(target_and_tok, tmp_path, captured, kind, fmt, draft_vocab):
    from huggingface_hub import ModelCard

    target, _ = target_and_tok
    out = export_heads(make(kind, target, draft_vocab), fmt, tmp_path / "out")
    saved = (out / "README.md").read_text()
    assert push_heads(out, "someorg/heads", license="mit") == "https://hub/someorg/heads"
    assert captured["files"] == sorted(p.name for p in out.iterdir())
    card = captured["card"]
    fm = yaml.safe_load(card.split("---\n")[1])
    assert fm == {"library_name": "headway", "license": "mit", "tags": ["speculative-decoding", kind, fmt],
                  "base_model": "someorg/tiny-llama"}
    assert ModelCard(card).data.to_dict() == fm
    assert "THIS_FOLDER" not in card and "someorg/heads" in card
    assert (out / "README.md").read_text() == saved  # the export's own README is left as written
    assert main(["push", str(out), "someorg/heads"]) == 0


def test_push_refuses_an_export_with_nan_weights(target_and_tok, tmp_path, captured):
    target, _ = target_and_tok
    out = export_heads(make("medusa", target, False), "trtllm", tmp_path / "out")
    f = out / "medusa_lm_head.safetensors"
    t = load_file(str(f))
    t["0.0.linear.weight"][0, 0] = math.nan
    f.chmod(0o644)
    save_file(t, str(f))
    with pytest.raises(Exception, match="medusa_lm_head.safetensors"):
        push_heads(out, "someorg/heads")
    assert "files" not in captured


def test_push_refuses_a_speculators_export_that_names_a_local_verifier(target_and_tok, tmp_path, captured):
    target, _ = target_and_tok
    heads = make("eagle3", target, True)
    heads.target_info.name_or_path = str(tmp_path / "my-target")
    out = export_heads(heads, "speculators", tmp_path / "out")
    with pytest.raises(HubError, match="verifier is the local path"):
        push_heads(out, "someorg/heads")
    assert "files" not in captured


def test_push_still_refuses_a_folder_that_is_neither(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HeadsError, match="no 'kind'"):
        push_heads(tmp_path / "x", "someorg/heads")


def test_export_card_names_a_local_target_by_its_folder(target_and_tok, tmp_path, captured):
    target, _ = target_and_tok
    heads = make("eagle3", target, True)
    heads.target_info.name_or_path = str(tmp_path / "models" / "my-llama")
    out = export_heads(heads, "vllm", tmp_path / "out")
    push_heads(out, "someorg/heads")
    assert str(tmp_path) not in captured["card"] and "my-llama" in captured["card"]
    assert Path(out / "README.md").read_text().count(str(tmp_path)) >= 1  # only the pushed card is scrubbed
