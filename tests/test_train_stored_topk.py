"""The target's top-k logits stored with the features (``headway features --topk_logits K``) and
distilled (``eagle.soft_labels`` / ``dflash.soft_labels: stored_topk``): what the folder holds, that
old folders still read, the renormalised top-k distribution and argmax training reads instead of
projecting ``final``, evaluation on the exact logits, and every refusal in one line."""

import json
import shlex
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.config import ConfigError, load_config
from headway.data.errors import DataError, ResumeMismatchError
from headway.data.features import TOPK_INDICES, TOPK_VALUES, FeaturesConfig, FeatureStore, features
from headway.data.merge import merge
from headway.target import load_target
from headway.testing import save_tiny_target
from headway.train.batch import StoredLogits, collate_features, stored_batch
from headway.train.config import TrainConfig
from headway.train.errors import TrainError
from headway.train.recipe import fit, train

from train_utils import distilled_rows, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target (vocabulary 384), its data, float32 features of layers 0..2 + final with the whole
    vocabulary as top-k (k = V: the stored distribution is the exact one), and with k = 8."""
    root = tmp_path_factory.mktemp("topk")
    target = save_tiny_target(root / "target")
    rows = [{**r, "index": i} for i, r in enumerate(distilled_rows(40, 384, seed=3))]
    data = save_rows(root / "data", rows)
    full = features(fcfg(data, root / "full", target, ["0", "1", "2", "final"], topk_logits=384))
    small = features(fcfg(data, root / "small", target, ["0", "1", "2"], topk_logits=8))
    plain = features(fcfg(data, root / "plain", target, ["0", "1", "2", "final"]))
    return root, target, data, full, small, plain


def fcfg(data, out, target, layers, **kw) -> FeaturesConfig:
    return FeaturesConfig(dataset=str(data), output=str(out), target=str(target), layers=list(layers),
                          store_dtype="float32", batch_size=4, shard_size=16, **kw)


# -- the folder ---------------------------------------------------------------------------------
def test_the_folder_stores_the_top_k_logits_where_the_next_token_is_an_answer_token(setup):
    _, target_dir, _, _, small, plain = setup
    model, _ = load_target(str(target_dir), device="cpu")
    store, exact = FeatureStore(small), FeatureStore(plain)
    manifest = json.loads((Path(small) / "features.json").read_text())
    assert store.keys == ["hidden_states.0", "hidden_states.1", "hidden_states.2", TOPK_VALUES, TOPK_INDICES]
    assert manifest["settings"]["topk_logits"] == 8 and "topk_logits" not in json.loads(
        (Path(plain) / "features.json").read_text())["settings"]  # folders without it keep their settings
    assert manifest["feature_bytes_per_token"] == 3 * 64 * 4 + 8 * 8
    for i in (0, 7):
        row, ref = store[i], exact[i]
        used = torch.zeros(len(row["loss_mask"]), dtype=torch.bool)
        used[:-1] = row["loss_mask"][1:].bool()
        logits = model.get_output_embeddings()(ref["final"]).float()  # (T, V)
        top = logits.topk(8, -1)
        assert row[TOPK_VALUES].dtype == torch.float32 and row[TOPK_INDICES].dtype == torch.int32
        torch.testing.assert_close(row[TOPK_VALUES][used], top.values[used], atol=1e-5, rtol=1e-5)
        assert torch.equal(row[TOPK_INDICES][used].long(), top.indices[used])
        assert not row[TOPK_VALUES][~used].any() and not row[TOPK_INDICES][~used].any()  # not projected there
        assert torch.equal(row[TOPK_INDICES][used, 0].long(), logits[used].argmax(-1))


def test_a_resume_with_another_k_and_a_merge_of_other_k_are_refused(setup, tmp_path):
    _, target, data, _, small, _ = setup
    with pytest.raises(ResumeMismatchError, match="topk_logits=8.*topk_logits=16"):
        features(fcfg(data, small, target, ["0", "1", "2"], topk_logits=16))
    other = features(fcfg(data, tmp_path / "k4", target, ["0", "1", "2"], topk_logits=4))
    with pytest.raises(DataError, match="topk_logits: 8 in .* but 4 in"):
        merge([small, other], tmp_path / "merged")
    with pytest.raises(DataError, match="topk_logits must be >= 0"):
        fcfg(data, tmp_path / "x", target, ["final"], topk_logits=-1)


# -- what training reads ------------------------------------------------------------------------
def test_from_topk_is_the_distribution_renormalised_over_the_top_k_and_its_rows():
    head = torch.nn.Linear(4, 6, bias=False)
    values = torch.tensor([[3.0, 1.0, 0.5]])  # tokens 4, 1, 2 lead, largest first
    indices = torch.tensor([[4, 1, 2]], dtype=torch.int32)
    full, top = StoredLogits(head, top="logits", soft="stored_topk").from_topk(values, indices)
    probs = torch.softmax(full, -1)[0]
    want = torch.softmax(values[0], -1)
    assert top.tolist() == [4] and probs[[0, 3, 5]].sum() == 0
    torch.testing.assert_close(probs[[4, 1, 2]], want)
    rows = torch.tensor([2, 4, 5])  # a draft vocabulary: token 1 is outside it, the rest renormalise
    part, top = StoredLogits(head, rows=rows, top="data", soft="stored_topk").from_topk(values, indices,
                                                                                        torch.tensor([2]))
    assert part.shape == (1, 3) and top.tolist() == [2]
    torch.testing.assert_close(torch.softmax(part, -1)[0], torch.softmax(torch.tensor([0.5, 3.0, -1e30]), -1))
    capped = StoredLogits(head, soft="stored_topk")
    capped.transform = lambda x: torch.tanh(x / 2) * 2  # the target's soft-cap goes over the stored values
    torch.testing.assert_close(capped.from_topk(values, indices)[0][0, 4], torch.tanh(torch.tensor(1.5)) * 2)


def test_a_batch_reads_its_stored_top_k_and_evaluation_the_exact_logits(setup):
    _, target_dir, _, full, small, _ = setup
    model, _ = load_target(str(target_dir), device="cpu")
    head = model.get_output_embeddings()
    keys = ["hidden_states.1", "final", TOPK_VALUES, TOPK_INDICES]
    batch = collate_features([FeatureStore(full).row(i, keys) for i in range(4)], pad_id=2)
    soft = StoredLogits(head, rows=torch.arange(0, 384, 3), top="data", soft="stored_topk")
    poisoned = {**batch, "features": {**batch["features"], "final": torch.full_like(batch["features"]["final"],
                                                                                   float("nan"))}}
    assert torch.isfinite(stored_batch(poisoned, [1], soft, torch.device("cpu"), torch.float32).logits).all()
    from_topk = stored_batch(batch, [1], soft, torch.device("cpu"), torch.float32)  # never reads `final`
    exact = stored_batch(batch, [1], soft.exact(), torch.device("cpu"), torch.float32)
    assert torch.isnan(stored_batch(poisoned, [1], soft.exact(), torch.device("cpu"), torch.float32).logits).any()
    used = exact.loss_mask[:, 1:].bool()
    # k = V: the stored distribution is the exact one (to float rounding) and so is the argmax
    torch.testing.assert_close(torch.softmax(from_topk.logits[:, :-1][used], -1),
                               torch.softmax(exact.logits[:, :-1][used], -1), atol=1e-6, rtol=1e-5)
    no_final = collate_features([FeatureStore(small).row(i, ["hidden_states.1", TOPK_VALUES, TOPK_INDICES])
                                 for i in range(4)], pad_id=2)
    tb = stored_batch(no_final, [1], soft.exact(), torch.device("cpu"), torch.float32)
    assert tb.logits.shape[-1] == 128  # no `final` to project: the stored top-k, even for evaluation


def config(setup, out: Path, kind: str, **kw) -> TrainConfig:
    _, target, data, *_ = setup
    base = {"kind": kind, "target": str(target), "output_dir": str(out), "batch_size": 4, "max_steps": 3,
            "log_every": 1, "save_every": 0, "eval_fraction": 0.25, "progress": False, "max_length": 20,
            "optim.lr": 3e-3, "eagle.ttt_steps": 3, "eagle.draft_vocab_size": 128, "dflash.block_size": 4,
            "dflash.draft_vocab_size": 128, "dflash.anchors": 4, "dflash.eval_anchors": 8, **kw}
    return load_config(TrainConfig, None, base)


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind,section", [("eagle3", "eagle"), ("dflash", "dflash"), ("eagle1", "eagle")])
def test_training_on_the_whole_vocabulary_as_top_k_equals_the_lm_head_route(setup, tmp_path, kind, section):
    """k = V: the renormalised top-k is the target's distribution, so the losses equal the lm_head's
    route step by step; the held-out evaluation reads the exact logits either way."""
    _, target, _, full, _, _ = setup
    model, tok = load_target(str(target), device="cpu")
    a = fit(config(setup, tmp_path / "lm_head", kind, features=str(full)), model, tok)
    b = fit(config(setup, tmp_path / "topk", kind, features=str(full), **{f"{section}.soft_labels": "stored_topk"}),
            model, tok)
    la, lb = ([r["loss"] for r in log(p.parent) if "loss" in r] for p in (a, b))
    torch.testing.assert_close(torch.tensor(lb), torch.tensor(la), atol=1e-5, rtol=1e-5)
    ea, eb = ([r["eval"] for r in log(p.parent) if "eval" in r][-1] for p in (a, b))
    assert ea["positions"] == eb["positions"] > 0 and eb["tau"] == pytest.approx(ea["tau"], abs=1e-4)


def test_a_small_k_trains_without_final_and_evaluates_on_exact_logits(setup, tmp_path):
    """Top-8 logits and no `final` in the training folder; the held-out folder stores `final`, so
    evaluation projects it (its held-out numbers equal those of the same heads evaluated by the lm_head
    route), and the soft labels differ from the exact ones (the losses do)."""
    _, target, _, full, small, plain = setup
    out = train(config(setup, tmp_path / "k8", "eagle3", features=str(small), eval_features=str(plain),
                       **{"eagle.soft_labels": "stored_topk"}))
    exact = train(config(setup, tmp_path / "exact", "eagle3", features=str(plain), eval_features=str(plain)))
    assert [r["loss"] for r in log(out.parent) if "loss" in r] != [r["loss"] for r in log(exact.parent) if "loss" in r]
    from headway.heads import load_heads

    assert load_heads(out).metadata["eval"]["positions"] == load_heads(exact).metadata["eval"]["positions"] > 0


def test_refusals_are_one_line(setup, tmp_path):
    _, target, data, full, small, plain = setup
    with pytest.raises(ConfigError, match="eagle.soft_labels=stored_topk reads the top-k logits"):
        config(setup, tmp_path / "x", "eagle3", data=str(data), **{"eagle.soft_labels": "stored_topk"})
    model, tok = load_target(str(target), device="cpu")
    with pytest.raises(TrainError) as e:
        fit(config(setup, tmp_path / "run", "dflash", features=str(plain), **{"dflash.soft_labels": "stored_topk"}),
            model, tok)
    msg = str(e.value)
    assert "\n" not in msg and "lack topk_values, topk_indices" in msg and "--topk_logits 64" in msg
    assert not (tmp_path / "run" / "log.jsonl").exists()
    cmd = msg.split("make them with: ")[1]
    assert main(shlex.split(cmd)[1:]) == 0  # the suggested command makes a folder that trains
    fit(config(setup, tmp_path / "ok", "dflash", features=cmd.split("--output ")[1].split()[0], max_steps=1,
               **{"dflash.soft_labels": "stored_topk"}), model, tok)
