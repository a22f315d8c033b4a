"""Draft calibration: reliability sums and fitted temperatures (train/calibration.py), stored with
the heads by training and ``fit_calibration``, and applied by the decoder when it ranks dynamic-tree
nodes (decode/trees.py) without changing what it emits."""

import json
import math

import pytest
import torch

from headway.config import load_config
from headway.decode import Speculator
from headway.decode.proposers import make_proposer
from headway.decode.sampling import SamplingParams
from headway.decode.shapes import DynamicShape
from headway.decode.trees import depth_temperature, dynamic_trees
from headway.heads import Eagle1Drafter, Eagle3Drafter, MedusaHeads, load_heads
from headway.heads.base import HeadsError
from headway.testing import save_tiny_target, tiny_target, tiny_tokenizer
from headway.train.calibrate import fit_calibration
from headway.train.calibration import TEMPERATURES, calibration_sums, summarize_calibration
from headway.train.config import TrainConfig
from headway.train.recipe import fit

from test_decode_exact import OracleProposer, prompts, reference, tie_free
from test_decode_sampling import (N_SAMPLES, chi_square_pvalue, exact_distribution, heads_for, speculative_samples,
                                  target, total_variation, tv_bound)  # noqa: F401 (target: the 6-token fixture)
from train_utils import distilled_rows, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")


# -- arithmetic ---------------------------------------------------------------------------------
def test_reliability_histogram_and_ece_on_hand_made_logits():
    """4 positions at top-1 probability .8 (3 right) and 2 at .6 (both right), plus one label
    outside the draft vocabulary (-1: a miss at .8, left out of the NLL)."""
    z8, z6 = torch.tensor([math.log(.8), math.log(.2)]), torch.tensor([math.log(.6), math.log(.4)])
    logits = torch.stack([z8] * 5 + [z6] * 2)  # (7, 2)
    labels = torch.tensor([0, 0, 0, 1, -1, 0, 0])
    s = calibration_sums([logits, logits[:1]], [labels, labels[:1]])
    assert s["calib_count"].shape == (2, 10) and s["calib_nll"].shape == (2, len(TEMPERATURES))
    assert s["calib_count"][0].tolist() == [0] * 6 + [2, 0, 5, 0]
    assert s["calib_hits"][0, 8] == 3 and s["calib_hits"][0, 6] == 2
    assert s["calib_conf"][0, 8].item() == pytest.approx(4.0) and s["calib_nll_n"][0].item() == 6
    one = TEMPERATURES.index(1.0)
    want = -(3 * math.log(.8) + math.log(.2) + 2 * math.log(.6))
    assert s["calib_nll"][0, one].item() == pytest.approx(want, rel=1e-5)
    out = summarize_calibration(s)
    assert out["positions"] == [7, 1]
    assert out["confidence"][0] == pytest.approx((5 * .8 + 2 * .6) / 7, abs=1e-4)
    assert out["accuracy"][0] == pytest.approx(5 / 7, abs=1e-4)
    assert out["ece"][0] == pytest.approx((abs(3 - 4.0) + abs(2 - 1.2)) / 7, abs=1e-4)
    assert out["ece"][1] == pytest.approx(0.2, abs=1e-4)  # one position at .8, right


@pytest.mark.parametrize("true_t", [0.5, 2.0])
def test_fitted_temperature_is_the_one_labels_were_drawn_at(true_t):
    """Labels drawn from softmax(z / T): the NLL is least at T on the grid; depths fit separately."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(20_000, 16, generator=g) * 2
    labels = torch.multinomial((z / true_t).softmax(-1), 1, generator=g)[:, 0]
    exact = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0]
    out = summarize_calibration(calibration_sums([z, z], [labels, exact]))
    assert out["temperature"] == [true_t, 1.0]
    assert out["nll_calibrated"][0] < out["nll"][0] and out["nll_calibrated"][1] == out["nll"][1]
    # sharper labels (T < 1) mean an underconfident drafter: accuracy above confidence
    assert (out["accuracy"][0] > out["confidence"][0]) == (true_t < 1)


def test_no_data_fits_temperature_one():
    s = calibration_sums([torch.zeros(0, 4)], [torch.zeros(0, dtype=torch.long)])
    out = summarize_calibration(s)
    assert out["temperature"] == [1.0] and out["positions"] == [0] and out["ece"] == [None]


# -- training stores it, fit_calibration reproduces it ----------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration")
    return (save_tiny_target(root / "target"), save_rows(root / "train", distilled_rows(24, 384, seed=1)),
            save_rows(root / "eval", distilled_rows(12, 384, seed=2)))


@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3"])
def test_training_stores_calibration_and_fit_calibration_reproduces_it(data, tmp_path, kind):
    from headway.target import load_target

    target_dir, train_data, eval_data = data
    cfg = load_config(TrainConfig, None, {
        "kind": kind, "target": str(target_dir), "data": str(train_data), "eval_data": str(eval_data),
        "output_dir": str(tmp_path / "run"), "batch_size": 4, "max_steps": 2, "save_every": 0, "progress": False,
        "eagle.ttt_steps": 2, "medusa.num_heads": 3, "eagle.draft_vocab_size": 128})
    model, tok = load_target(str(target_dir), device="cpu")
    final = fit(cfg, model, tok)
    meta = json.loads((final / "config.json").read_text())["metadata"]
    ev = meta["eval"]["calibration"]
    depth = 3 if kind == "medusa" else 5
    assert len(ev["temperature"]) == len(ev["ece"]) == len(ev["confidence"]) == depth
    grid = [round(x, 4) for x in TEMPERATURES]
    assert all(0 <= e <= 1 for e in ev["ece"]) and all(t in grid for t in ev["temperature"])
    cal = meta["calibration"]
    assert cal["temperature_by_depth"] == ev["temperature"] and cal["fitted_on"] == "held-out eval data"
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert any("calibration" in r.get("eval", {}) for r in log)

    heads = load_heads(final, target=model)
    refit = fit_calibration(heads, model, eval_data, depth=5, batch_size=3)
    assert refit["temperature_by_depth"] == cal["temperature_by_depth"]
    assert refit["summary"]["positions"] == ev["positions"]
    assert refit["summary"]["ece"] == pytest.approx(ev["ece"], abs=2e-4)


# -- the decoder ------------------------------------------------------------------------------------
class FixedProposer:
    """Depth d's draft distribution: top-1 probability ``p1[d-1]``, the rest spread evenly (one row)."""

    max_depth = None

    def __init__(self, p1, temperatures=None, V=50):
        self.p1, self.V, self.temperatures = p1, V, temperatures

    def _logp(self, depth):
        p = torch.full((self.V,), (1 - self.p1[depth - 1]) / (self.V - 1))
        p[depth] = self.p1[depth - 1]
        return p.log()

    def root_logprobs(self):
        return self._logp(1)[None]

    def expand(self, parent_rows, tokens, depth):
        return self._logp(depth + 1).expand(*tokens.shape, -1)

    def to_target_ids(self, ids):
        return ids


def build_dynamic(shape, proposer, root):
    return dynamic_trees([shape], proposer, root.view(1))[0]


def test_temperatures_reshape_dynamic_trees():
    """Underconfident drafts (top-1 .3 at each depth) go wide; sharpened (T = .25) they go deep;
    softened (T = 4) wider still. The temperature of depth d applies to depth-d drafts."""
    shape = DynamicShape(top_k=4, depth=6, total_tokens=12)
    root = torch.tensor(0)
    sharp = build_dynamic(shape, FixedProposer([.3] * 6, [0.25]), root)
    soft = build_dynamic(shape, FixedProposer([.3] * 6, [4.0]), root)
    plain = build_dynamic(shape, FixedProposer([.3] * 6, None), root)
    assert [int(t.buffers.depth.max()) for t in (sharp, plain, soft)] == [6, 4, 2]
    # per depth: sharpen only depth 1, and the tree spends its budget below the depth-1 top-1 draft
    d1 = build_dynamic(shape, FixedProposer([.3] * 6, [0.25, 1.0]), root)
    assert int((d1.buffers.depth == 1).sum()) < int((plain.buffers.depth == 1).sum())
    assert depth_temperature(FixedProposer([.3], [0.5, 2.0]), 1) == 0.5
    assert depth_temperature(FixedProposer([.3], [0.5, 2.0]), 5) == 2.0  # the last fitted depth holds
    assert depth_temperature(FixedProposer([.3]), 3) == 1.0


def calibrated_heads(kind, model, temps):
    torch.manual_seed(1)
    if kind == "medusa":
        heads = MedusaHeads.for_target(model, num_heads=4)
        with torch.no_grad():
            for p in heads.blocks.parameters():
                p.normal_(0, 0.05)
    else:
        heads = (Eagle1Drafter if kind == "eagle1" else Eagle3Drafter).for_target(model)
    heads.metadata["calibration"] = {"temperature_by_depth": temps, "fitted_on": "test"}
    return heads


def test_proposer_reads_temperatures_from_metadata_and_round_trips(tmp_path):
    model, tok = tiny_target("llama")
    heads = calibrated_heads("eagle1", model, [0.2, 5.0])
    assert make_proposer(heads).temperatures == [0.2, 5.0]
    assert make_proposer(heads, calibrate=False).temperatures is None
    back = load_heads(heads.save_pretrained(tmp_path / "h"), target=model)
    assert back.metadata["calibration"] == {"temperature_by_depth": [0.2, 5.0], "fitted_on": "test"}
    assert Speculator(model, tok, back).new_proposer().temperatures == [0.2, 5.0]
    assert Speculator(model, tok, back, calibrate=False).new_proposer().temperatures is None
    assert make_proposer(calibrated_heads("medusa", model, [1.5])).temperatures == [1.5]
    for bad in ([0.0], ["x"], [float("nan")], 3):
        back.metadata["calibration"] = {"temperature_by_depth": bad}
        with pytest.raises(HeadsError, match="temperature_by_depth"):
            make_proposer(back)


def test_calibration_changes_the_drafted_tree_of_real_heads():
    model, tok = tiny_target("llama")
    heads = calibrated_heads("eagle1", model, [1.0])
    p = prompts(tok, n=1)[0]
    trees = {}
    for temps in ([0.05], [20.0]):
        heads.metadata["calibration"] = {"temperature_by_depth": temps}
        spec = Speculator(model, tok, heads, tree="dynamic-4-6-12")
        state = spec.start(spec.encode(p), SamplingParams(), torch.Generator())
        trees[temps[0]] = spec.draft_and_score(state).tree.buffers.depth
    assert int(trees[0.05].max()) > int(trees[20.0].max())  # sharp: deep; soft: wide


@pytest.mark.parametrize("kind", ["medusa", "eagle1", "eagle3"])
def test_greedy_output_is_exact_with_extreme_calibration(kind):
    model, tok = tiny_target("llama")
    ps, refs = [], []
    for p in prompts(tok, n=14, seed=4):
        ref = reference(model, p, 12)
        if tie_free(model, p, ref) and len(ps) < 8:
            ps.append(p)
            refs.append(ref)
    assert len(ps) == 8
    for temps in ([0.2, 5.0, 0.2, 5.0], [5.0, 0.2], [0.2]):
        heads = calibrated_heads(kind, model, temps)
        for shape in ("chain-4", "dynamic-4-4-12", "dynamic-8-6-24"):
            spec = Speculator(model, tok, heads, tree=shape)
            for p, ref in zip(ps, refs):
                assert spec.generate(p, max_new_tokens=12).ids == ref, (kind, temps, shape, p)


def test_oracle_drafts_stay_exact_under_extreme_calibration():
    """Drafts that are often right (the oracle of test_decode_exact), ranked with extreme per-depth
    temperatures: many acceptance paths, the same output."""
    model, tok = tiny_target("llama")
    V = model.config.vocab_size
    heads = calibrated_heads("eagle1", model, [1.0])
    taus = []
    for temps in ([0.2, 5.0, 0.2], [5.0, 0.2, 5.0]):
        for shape in ("dynamic-4-5-16", "chain-5"):
            spec = Speculator(model, tok, heads, tree=shape)
            for i, p in enumerate(prompts(tok, n=3, seed=3)):
                ref = reference(model, p, 60)

                def oracle(ref=ref, p=p, i=i):
                    proposer = OracleProposer(make_proposer(spec.heads), ref, len(p), V, seed=i)
                    proposer.temperatures = temps
                    return proposer

                spec.new_proposer = oracle
                out = spec.generate(p, max_new_tokens=60)
                assert out.ids == ref, (temps, shape, i)
                taus.append(out.stats.tau)
    assert min(taus) > 1.5


@pytest.mark.parametrize("kind,shape", [("eagle1", "dynamic-3-3-8"), ("medusa", "dynamic-3-3-8"),
                                        ("eagle3", "chain-3")])
def test_sampling_stays_exact_under_extreme_calibration(target, kind, shape):
    """At temperature 1 (the 6-token target of test_decode_sampling): dynamic trees ranked with
    extreme temperatures (recursive rejection over deterministic drafts), and sampled chains, which
    draw from the raw draft distribution."""
    params = SamplingParams(temperature=1.0)
    heads = heads_for(kind, target)
    heads.metadata["calibration"] = {"temperature_by_depth": [0.2, 5.0, 0.2]}
    spec = Speculator(target, tiny_tokenizer(), heads, tree=shape)
    assert spec.new_proposer().temperatures == [0.2, 5.0, 0.2]
    probs = exact_distribution(target, params)
    counts = speculative_samples(spec, params, N_SAMPLES, seed=7)
    p = chi_square_pvalue(counts, probs, N_SAMPLES)
    assert p > 1e-3, (kind, shape, p)
    assert total_variation(counts, probs, N_SAMPLES) < tv_bound(probs, N_SAMPLES), (kind, shape)
