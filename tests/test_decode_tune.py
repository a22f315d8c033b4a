import json
from typing import Any

import pytest
import torch

from headway.cli import main
from headway.decode import Speculator
from headway.decode.shapes import StaticShape, chain
from headway.bench.methods import tree_spec
from headway.bench.tune import (SPECULATE_MARGIN, Budget, TuneConfig, batch_choice, expected_accepted, interpolate,
                                run_side_by_side, shape_spec, tune)
from headway.decode.shapes import parse_shape
from headway.heads import Eagle1Drafter, MedusaHeads
from headway.testing import sample_texts


def test_expected_accepted_and_interpolation():
    acc = [[0.5, 0.2], [0.4, 0.1]]
    shape = StaticShape([(0,), (1,), (0, 0)])
    assert abs(expected_accepted(shape, acc) - (0.5 + 0.2 + 0.5 * 0.4)) < 1e-9
    assert interpolate({1: 1.0, 5: 3.0}, 3) == 2.0 and interpolate({1: 1.0, 5: 3.0}, 10) == 6.0


def test_shape_spec_round_trip():
    for shape in (chain(3), StaticShape([(0,), (1,), (0, 2)])):
        assert parse_shape(shape_spec(shape)).paths == shape.paths
    assert shape_spec(parse_shape("dynamic-4-5-16")) == "dynamic-4-5-16"
    # a chain is stored by name, and one written out as a static path is named a chain in reports
    assert shape_spec(chain(2)) == shape_spec(parse_shape("static:[[0],[0,0]]")) == "chain-2"
    assert tree_spec(parse_shape("static:[[0]]")) == "chain-1"
    # a static tree is reported by its paths (two of them in one bench stay apart), which read back
    assert tree_spec(parse_shape("static: [[0], [1]]")) == "static:[[0],[1]]"
    assert parse_shape(tree_spec(parse_shape("static:[[0],[1],[1,0]]"))).paths == [(0,), (1,), (1, 0)]


def test_tune_stores_the_fastest_tree_and_generate_uses_it(tmp_path, llama_dir, capsys):
    from headway.target import load_target

    model, tok = load_target(str(llama_dir))
    torch.manual_seed(0)
    for heads in (MedusaHeads.for_target(model, num_heads=3), Eagle1Drafter.for_target(model)):
        hdir = heads.save_pretrained(tmp_path / heads.kind)
        prompts = tmp_path / "p.jsonl"
        text = sample_texts(20_000)[0]
        prompts.write_text("".join(json.dumps({"prompt": text[i * 300:i * 300 + 200]}) + "\n" for i in range(3)))
        cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=3,
                         max_new_tokens=12, probe_depth=3, probe_rank=3, sizes=[2, 4], finalists=1, repeats=1,
                         temperatures=[0.0, 1.0], json_out=str(tmp_path / "tune.json"),
                         budget_s=None)  # every run is counted below: no budget may cut them on a busy machine
        rng = torch.get_rng_state()
        report = tune(cfg, log=lambda m: None)
        assert torch.equal(torch.get_rng_state(), rng)  # probes and sampled runs draw from their own generators
        lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tune: ")]  # not a terminal
        runs = 2 * 3 * len(report["mean_tokens_per_s"])  # temperatures x prompts x trees
        assert lines and lines[-1].split()[1] == f"{runs}/{runs}" and all("runs/s" in x and "ETA" in x for x in lines)
        runs = report["side_by_side"]
        assert set(runs) == {"0.0", "1.0"} or set(runs) == {0.0, 1.0} or len(runs) == 2
        greedy, sampled = ({n: r["tokens_per_s"] for n, r in runs[t].items()} for t in sorted(runs, key=float))
        assert report["chosen"] == max(greedy, key=greedy.get)  # the fastest measured tree at T=0 wins ...
        assert report["sampling_chosen"] == max(sampled, key=sampled.get)  # ... and the fastest at T=1 above 0
        assert len(report["acceptance"]) == 3 and all(0 <= a <= 1 for row in report["acceptance"] for a in row)
        stored = json.loads((hdir / "config.json").read_text())["metadata"]["decode"]
        assert stored["tree"] == report["tree"]
        assert stored.get("sampling_tree", report["tree"]) == report["sampling_tree"]  # written only where it differs
        spec = Speculator.from_pretrained(str(llama_dir), str(hdir))
        assert shape_spec(spec.tree_for(0.0)) == shape_spec(spec.fit_tree(report["tree"]))
        assert shape_spec(spec.tree_for(1.0)) == shape_spec(spec.fit_tree(report["sampling_tree"]))


def test_tune_picks_a_tree_for_peagle_heads_and_generate_uses_it(tmp_path, llama_dir):
    """P-EAGLE drafts every depth in one call: tune probes its per-depth ranks, measures its chains and
    trees, and stores the winner, no deeper than K."""
    from headway.heads import PEagleDrafter
    from headway.target import load_target

    model, tok = load_target(str(llama_dir))
    torch.manual_seed(0)
    hdir = PEagleDrafter.for_target(model, draft_vocab_size=128, num_depths=3).save_pretrained(tmp_path / "peagle")
    prompts = tmp_path / "p.jsonl"
    text = sample_texts(20_000)[0]
    prompts.write_text("".join(json.dumps({"prompt": text[i * 300:i * 300 + 200]}) + "\n" for i in range(2)))
    cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=2, max_new_tokens=10,
                     probe_depth=3, probe_rank=2, sizes=[2, 4], finalists=1, repeats=1, temperatures=[0.0],
                     json_out=str(tmp_path / "tune.json"))
    report = tune(cfg, log=lambda m: None)
    assert len(report["acceptance"]) == 3
    spec = Speculator.from_pretrained(str(llama_dir), str(hdir))
    assert shape_spec(spec.tree_for(0.0)) == shape_spec(spec.fit_tree(report["tree"])) and spec.tree.depth <= 3
    p = tok(text[:200])["input_ids"]
    x = torch.tensor([p])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)[0, len(p):]
    assert spec.generate(p, max_new_tokens=10).ids == ref.tolist()


def eagle1_and_prompts(tmp_path, llama_dir, n: int):
    """The target, its tokenizer, untrained EAGLE-1 heads saved beside it, a file of ``n`` prompts
    and the text they were cut from."""
    from headway.target import load_target

    model, tok = load_target(str(llama_dir))
    torch.manual_seed(0)
    hdir = Eagle1Drafter.for_target(model).save_pretrained(tmp_path / "eagle1")
    prompts = tmp_path / "p.jsonl"
    text = sample_texts(20_000)[0]
    prompts.write_text("".join(json.dumps({"prompt": text[i * 300:i * 300 + 200]}) + "\n" for i in range(n)))
    return model, tok, hdir, prompts, text


def test_tune_stores_speculate_or_plain_per_batch_size(tmp_path, llama_dir, capsys, monkeypatch):
    """``batch_sizes``: speculating against plain decoding, measured per batch size and stored; the
    speculator loaded from the heads then follows the table. The measurements are injected (through
    ``run_side_by_side`` and ``timed_batch``, what tune measures with), so which tree wins, and where
    drafting pays, is set by the test, not by the machine's load."""
    from headway.bench import tune as tune_mod

    model, tok, hdir, prompts, text = eagle1_and_prompts(tmp_path, llama_dir, 2)
    fastest = {0.0: "chain-2", 1.0: "fork-1"}  # the single-prompt winners tune stores as tree / sampling_tree

    def fake_runs(spec, shapes, prompts, max_new, temperature, repeats, progress=None, budget=None):
        return {n: {"tokens_per_s": 10.0 + (n == fastest[temperature]), "tau": 1.0, "prompts": 2} for n in shapes}

    # tokens/s per (batch size, sampled, candidate): greedy drafting pays at 1 only (chain-1 at 2 is a
    # near-tie under the margin); sampled, the tuned fork-1 loses at 1 and fork-2 wins at 2
    rates = {(1, False): {"plain": 10.0, "chain-2": 20.0},
             (2, False): {"plain": 10.0, "chain-2": 9.0, "chain-1": 10.3, "chain-3": 8.0},
             (1, True): {"plain": 10.0, "fork-1": 9.0},
             (2, True): {"plain": 10.0, "fork-1": 9.5, "chain-1": 9.0, "chain-2": 8.0, "chain-3": 7.0,
                         "fork-2": 12.0}}
    timed: list[tuple[int, float, str]] = []

    def fake_timed_batch(spec, rows, max_new, temperature, seed):
        entry = spec.policy.by_batch[1]  # the candidate measure_batch_cutover set up
        name = "plain" if entry is False else shape_spec(spec.tree_for(temperature) if entry is True else entry)
        timed.append((len(rows), temperature, name))
        tokens = len(rows) * max_new
        return tokens, tokens / rates[len(rows), temperature > 0][name]

    monkeypatch.setattr(tune_mod, "run_side_by_side", fake_runs)
    monkeypatch.setattr(tune_mod, "timed_batch", fake_timed_batch)
    cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=2, max_new_tokens=12,
                     probe_depth=2, probe_rank=2, sizes=[2], finalists=1, repeats=1, batch_sizes=[1, 2],
                     temperatures=[0.0, 1.0])
    report = tune(cfg, log=lambda m: None)
    assert (report["chosen"], report["sampling_chosen"]) == ("chain-2", "fork-1")
    side = report["by_batch_side_by_side"]
    assert sorted(side) == [1, 2]
    # its own progress lines (not a terminal): every candidate x (warm-up + repeats) x temperature, counted
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tune by batch size: ")]
    runs = sum(len(m["candidates"]) * 2 for modes in side.values() for m in modes.values())
    assert lines and lines[-1].split()[4] == f"{runs}/{runs}" and all("ETA" in x for x in lines)
    assert len(timed) == runs and {(b, t) for b, t, _ in timed} == {(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)}
    assert all(sorted(modes) == ["greedy", "sampling"] for modes in side.values())  # T=0 and T>0 measured apart
    # one prompt: the tuned tree against plain decoding; two: the short chains too, and when sampling the forks
    for (b, sampled), want in rates.items():
        assert side[b]["sampling" if sampled else "greedy"]["candidates"] == pytest.approx(want)
    decode = json.loads((hdir / "config.json").read_text())["metadata"]["decode"]
    assert decode["by_batch"] == {"1": True, "2": False}  # the tuned chain-2 at 1; the near-tie is plain
    assert decode["by_batch_sampling"] == {"1": False, "2": "fork-2"}
    assert side[2]["greedy"]["tree"] is None and side[2]["sampling"]["tree"] == "fork-2"

    spec = Speculator.from_pretrained(str(llama_dir), str(hdir))
    for table, key in ((spec.policy.by_batch, "by_batch"), (spec.policy.by_batch_sampling, "by_batch_sampling")):
        assert {b: v if isinstance(v, bool) else shape_spec(v) for b, v in table.items()} == \
            {int(b): v for b, v in decode[key].items()}
    assert spec.policy.speculate(1) and not spec.policy.speculate(2)
    assert not spec.policy.speculate(1, sampling=True) and spec.policy.speculate(2, sampling=True)
    ids = tok(text[:200])["input_ids"]
    out = spec.generate_batch([ids, ids[:40]], max_new_tokens=10)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    assert out.rows[0].ids == ref


class _StubStats:
    def __init__(self, tokens: int, seconds: float):
        self.new_tokens, self.time_total, self.tau = tokens, seconds, 1.0


class _StubSpec:
    """Enough of a Speculator for ``run_side_by_side``: each generation takes one second of a fake clock."""

    def __init__(self):
        self.tree = self.sampling_tree = None
        self.now = 0.0
        self.calls: list[tuple[str, Any]] = []

    def generate(self, prompt, max_new_tokens, temperature, seed):
        self.now += 1.0
        self.calls.append((self.tree, prompt))
        return type("Out", (), {"stats": _StubStats(max_new_tokens, 1.0)})()


def test_a_spent_budget_stops_between_prompts_and_keeps_what_was_measured():
    """The budget is checked between prompts: every candidate has run the same prompts when it stops,
    the first prompt always runs, and each candidate reports how many prompts it was measured on."""
    spec = _StubSpec()
    budget = Budget(5.0, clock=lambda: spec.now)
    shapes = {"a": "A", "b": "B", "c": "C"}
    out = run_side_by_side(spec, shapes, ["p0", "p1", "p2", "p3"], 8, 0.0, 2, budget=budget)  # type: ignore[arg-type]
    # warm-up 1 s, prompt 0 at 1..4 s (not spent), prompt 1 at 4..7 s, then spent: 2 of 8 prompt runs
    assert {r["prompts"] for r in out.values()} == {2}
    measured = spec.calls[1:]
    assert sorted(measured) == sorted((s, p) for s in "ABC" for p in ("p0", "p1"))
    spec = _StubSpec()
    out = run_side_by_side(spec, shapes, ["p0", "p1"], 8, 0.0, 2, budget=Budget(0.0, clock=lambda: spec.now))
    assert {r["prompts"] for r in out.values()} == {1} and len(spec.calls) == 1 + 3  # the first prompt always runs
    spec = _StubSpec()
    out = run_side_by_side(spec, shapes, ["p0", "p1"], 8, 0.0, 2, budget=Budget(None, clock=lambda: spec.now))
    assert {r["prompts"] for r in out.values()} == {4}  # no limit: every repeat of every prompt


def test_tune_within_a_spent_budget_keeps_the_best_measured_and_stores_plain_for_the_rest(tmp_path, llama_dir):
    """A budget spent before the trees are run (as a tiny one always is): each temperature measures
    its first prompt, the fastest tree of those runs is stored, tune says so, and the batch sizes it
    had no time for are stored as plain decoding (never slower than plain decoding)."""
    _, _, hdir, prompts, _ = eagle1_and_prompts(tmp_path, llama_dir, 3)
    said: list[str] = []
    cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=3, max_new_tokens=6,
                     probe_depth=2, probe_rank=2, sizes=[2], finalists=1, repeats=2, batch_sizes=[2, 4],
                     budget_s=1e-9)
    report = tune(cfg, log=said.append)
    assert report["budget"] == {"budget_s": 1e-9, "planned_prompt_runs": 6, "measured_prompt_runs": {"0.0": 1},
                                "spent": True}
    assert all(r["prompts"] == 1 for r in report["side_by_side"]["0.0"].values())
    speed = report["mean_tokens_per_s"]
    assert report["chosen"] == max(speed, key=speed.get)
    assert any(m.startswith("plan: ") and "budget 1e-09 s" in m for m in said)
    assert any(m.startswith("budget of 1e-09 s spent: kept the fastest") for m in said)
    assert any("batch sizes 2, 4 not measured" in m for m in said)
    stored = json.loads((hdir / "config.json").read_text())["metadata"]["decode"]
    assert stored["tree"] == report["tree"] and stored["by_batch"] == {"2": False, "4": False}
    assert not Speculator.from_pretrained(str(llama_dir), str(hdir)).policy.speculate(4)


def test_tune_cli_bad_heads_path_is_one_line_error(capsys, llama_dir):
    assert main(["tune", "--target", str(llama_dir), "--heads", "/nonexistent/heads"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("headway tune: error:") and "not found" in err[-1]


def test_tune_measures_every_chain_and_stores_fitted_calibration(tmp_path, llama_dir):
    """The stored tree is the measured best of candidates that include chain-1 .. chain-D, so it is
    never slower than the best chain on the same prompts; ``calibration_data`` fits temperatures
    for heads that have none, and they are stored with the tree (and used by generate)."""
    from headway.target import load_target
    from train_utils import distilled_rows, save_rows

    model, _ = load_target(str(llama_dir))
    torch.manual_seed(0)
    hdir = Eagle1Drafter.for_target(model).save_pretrained(tmp_path / "eagle1")
    data = save_rows(tmp_path / "data", distilled_rows(6, 384, seed=1))
    prompts = tmp_path / "p.jsonl"
    text = sample_texts(20_000)[0]
    prompts.write_text("".join(json.dumps({"prompt": text[i * 300:i * 300 + 200]}) + "\n" for i in range(2)))
    cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=2, max_new_tokens=8,
                     probe_depth=3, probe_rank=2, sizes=[2, 4], finalists=1, repeats=1, calibration_data=str(data))
    report = tune(cfg, log=lambda m: None)
    speed = report["mean_tokens_per_s"]
    assert {"chain-1", "chain-2", "chain-3"} <= set(speed) and any(n.startswith("dynamic-") for n in speed)
    assert report["chosen"] == max(speed, key=speed.get)
    assert speed[report["chosen"]] >= max(v for n, v in speed.items() if n.startswith("chain-"))
    assert report["best_chain"] in speed and report["calibrated"]
    temps = report["calibration"]["temperature_by_depth"]
    assert len(temps) == 3 and len(report["calibration"]["summary"]["ece"]) == 3
    meta = json.loads((hdir / "config.json").read_text())["metadata"]
    assert meta["decode"]["tree"] == report["tree"] and meta["decode"]["calibrated"]
    assert meta["calibration"]["temperature_by_depth"] == temps and "summary" not in meta["calibration"]
    assert meta["calibration"]["fitted_on"] == str(data)
    assert Speculator.from_pretrained(str(llama_dir), str(hdir)).new_proposer().temperatures == temps


def test_tune_keeps_a_tree_per_temperature_and_decoders_use_each(tmp_path, llama_dir, monkeypatch):
    """With a fake clock where chain-2 is fastest at T=0 and chain-1 at T=1, tune stores both
    (``tree`` / ``sampling_tree``); generate (``from_pretrained``) and bench draft each at its
    temperature, and an explicit tree still serves both. Tuned at T=0 alone, one tree is stored."""
    from headway.bench import tune as tune_mod
    from headway.bench.configs import BenchConfig
    from headway.bench.run import headway_methods
    from headway.target import load_target

    model, tok = load_target(str(llama_dir))
    torch.manual_seed(0)
    hdir = Eagle1Drafter.for_target(model).save_pretrained(tmp_path / "eagle1")
    fast = {0.0: "chain-2", 1.0: "chain-1"}

    def fake_runs(spec, shapes, prompts, max_new, temperature, repeats, progress=None, budget=None):
        return {n: {"tokens_per_s": 10.0 + (n == fast[temperature]), "tau": 1.0, "prompts": 1} for n in shapes}

    monkeypatch.setattr(tune_mod, "run_side_by_side", fake_runs)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": sample_texts(2_000)[0][:200]}) + "\n")
    cfg = TuneConfig(target=str(llama_dir), heads=str(hdir), prompts=str(prompts), num_prompts=1, max_new_tokens=4,
                     probe_depth=2, probe_rank=2, sizes=[2], finalists=1, repeats=1, temperatures=[0.0, 1.0])
    report = tune(cfg, log=lambda m: None)
    assert (report["chosen"], report["sampling_chosen"]) == ("chain-2", "chain-1")
    stored = json.loads((hdir / "config.json").read_text())["metadata"]["decode"]
    assert (stored["tree"], stored["sampling_tree"]) == ("chain-2", "chain-1")
    spec = Speculator.from_pretrained(str(llama_dir), str(hdir))
    assert (spec.tree_for(0.0).depth, spec.tree_for(0.7).depth) == (2, 1)
    assert Speculator.from_pretrained(str(llama_dir), str(hdir), tree="chain-3").tree_for(1.0).depth == 3
    methods = headway_methods(model, tok, BenchConfig(target=str(llama_dir), heads=[str(hdir)]))
    assert [methods[0].label_at(t)[:2] for t in (0.0, 1.0)] == [("eagle1[chain-2]", "chain-2"),
                                                                 ("eagle1[chain-1]", "chain-1")]
    both = headway_methods(model, tok, BenchConfig(target=str(llama_dir), heads=[str(hdir)],
                                                   tree=["chain-3", "stored"]))
    assert [m.label_at(1.0)[1] for m in both] == ["chain-3", "chain-1"]  # a named tree at every temperature
    assert both[1].label_at(0.0)[1] == "chain-2"

    tune(TuneConfig(**{**cfg.__dict__, "temperatures": [0.0]}), log=lambda m: None)  # T=0 only: one tree
    stored = json.loads((hdir / "config.json").read_text())["metadata"]["decode"]
    assert stored["tree"] == "chain-2" and "sampling_tree" not in stored
    assert Speculator.from_pretrained(str(llama_dir), str(hdir)).tree_for(1.0).depth == 2


def test_a_batch_size_drafts_only_where_drafting_beats_plain_decoding_by_the_margin():
    assert batch_choice({"plain": 100.0, "chain-1": 104.0, "chain-2": 90.0}) == "plain"  # a near-tie: plain
    assert batch_choice({"plain": 100.0, "chain-1": 104.0, "chain-2": 106.0}) == "chain-2"
    assert batch_choice({"plain": 100.0, "measured-4": 100.0 * SPECULATE_MARGIN}) == "measured-4"
    assert batch_choice({"plain": 100.0, "measured-4": 99.0}) == "plain"
