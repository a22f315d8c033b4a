"""benchmarks/peers' "peers at their best" machinery (issue #59 item 4), without any peer installed: each
peer's own defaults, the plan, resumption, the choice of LR on dev only, the spread over seeds, and one
timing method for every tool."""

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "benchmarks" / "peers"


def _module(name):
    """A harness script as module ``name`` (they import each other by bare name)."""
    if name in sys.modules and getattr(sys.modules[name], "__file__", "") == str(HARNESS / f"{name}.py"):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HARNESS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


defaults = _module("defaults")
protocol = _module("protocol")
sweep = _module("sweep")
throughput = _module("throughput")
BRACKET = [1e-3, 2e-3, 4e-3]


# ---- each peer's own defaults

def test_own_defaults_are_the_releases_and_cite_their_source():
    own = {p: {k: v for k, (v, _) in table.items()} for p, table in defaults.OWN.items()}
    assert {"lr": 1e-3, "optimizer": "muon", "epochs": 20, "ttt_steps": 3, "seed": 42}.items() <= own["speculators"].items()
    assert {"lr": 1e-4, "epochs": 1, "ttt_steps": 3, "precision": "bf16", "seed": 42}.items() <= own["modelopt"].items()
    assert {"lr": 1e-4, "epochs": 1, "ttt_steps": 7, "precision": "bf16", "seed": 42}.items() <= own["specforge"].items()
    assert own["speculators"]["precision"].startswith("bf16")
    for peer, table in defaults.OWN.items():
        assert set(table) == {"lr", "optimizer", "epochs", "ttt_steps", "precision", "draft_vocab", "batch", "seed"}
        assert all(source for _, source in table.values()), peer
    assert defaults.RECOMMENDED_LR == {"headway": 2e-3, **{p: own[p]["lr"] for p in defaults.PEERS}}


@pytest.mark.parametrize("peer", ["speculators", "modelopt", "specforge"])
def test_own_mode_writes_nothing_but_the_vocabulary_and_epochs(peer):
    """Its LR, TTT length, precision, optimiser and seed stay the tool's: the runner passes no option for them."""
    s = defaults.own(peer)
    assert s["draft_vocab_size"] == defaults.OWN_DRAFT_VOCAB
    assert s["options"] == {defaults.option(peer, "epochs"): defaults.OWN[peer]["epochs"][0]}
    assert defaults.own(peer, epochs_cap=2)["options"] == {defaults.option(peer, "epochs"): min(2, defaults.OWN_EPOCHS[peer])}


@pytest.mark.parametrize("peer", ["speculators", "modelopt", "specforge"])
def test_shared_mode_is_headways_vocabulary_ttt_and_epochs(peer):
    s = defaults.shared(peer, 8192, 2, 3, 2e-3)
    assert s["draft_vocab_size"] == 8192
    opts = s["options"]
    assert opts[defaults.option(peer, "epochs")] == 2 and opts[defaults.option(peer, "ttt_steps")] == 3
    assert opts[defaults.option(peer, "lr")] == 2e-3


def test_the_shared_vocabulary_is_the_recipes():
    """The comparison's draft vocabulary size is the one headway's recipe trains with."""
    recipe = yaml.safe_load((ROOT / "configs" / "smollm2" / "eagle3-1k5.yaml").read_text())
    assert sweep.parse_args([]).draft_vocab == recipe["eagle"]["draft_vocab_size"]
    assert sweep.parse_args([]).ttt_steps == recipe["eagle"]["ttt_steps"]
    assert sweep.parse_args([]).epochs == recipe["epochs"]


# ---- the plan

def test_plan_has_every_tool_mode_and_seed_and_the_bracket_last():
    jobs = protocol.plan([0, 1, 2], BRACKET)
    by = {k: [j for j in jobs if (j.tool, j.mode) == k] for k in {(j.tool, j.mode) for j in jobs}}
    assert [j.seed for j in by[("headway", "recipe")]] == [0, 1, 2]
    spec = by[("speculators", "own")]
    assert [(j.lr, j.seed, j.stage) for j in spec] == [(1e-3, 0, 1), (2e-3, 0, 1), (4e-3, 0, 1),
                                                      ("best", 1, 2), ("best", 2, 2)]
    for peer in ("modelopt", "specforge"):
        assert [(j.lr, j.seed) for j in by[(peer, "own")]] == [(None, 0), (None, 1), (None, 2)]
    for peer in defaults.PEERS:
        assert [(j.lr, j.seed) for j in by[(peer, "shared")]] == [(2e-3, 0), (2e-3, 1), (2e-3, 2)]
    assert len(jobs) == 3 + 5 + 3 + 6 + 6
    assert [j.stage for j in jobs] == sorted(j.stage for j in jobs)  # stage 2 after every stage-1 run
    named = [j.name for j in jobs if j.lr != "best"]
    assert len(set(named)) == len(named)
    with pytest.raises(ValueError, match="chosen after stage 1"):
        jobs[-1].name
    assert [(j.lr, j.seed) for j in protocol.plan([5], [], ["speculators"]) if j.mode == "own"] == [(None, 5)]


def test_stage_two_takes_the_lr_with_the_best_dev_tau_and_waits_until_all_are_scored():
    jobs = protocol.plan([0, 1], BRACKET, ["speculators"])
    part = {("speculators", "own", 1e-3): 1.40, ("speculators", "own", 2e-3): 1.54}
    assert [j.lr for j in protocol.resolve(jobs, part) if j.stage == 2] == ["best"]
    full = {**part, ("speculators", "own", 4e-3): 1.50}
    assert [(j.lr, j.seed) for j in protocol.resolve(jobs, full) if j.stage == 2] == [(2e-3, 1)]
    assert protocol.best_lr({4e-3: 1.5, 1e-3: 1.5}) == 1e-3  # a tie: the smaller LR


def _score(root, job, name, tau, data):
    folder = sweep.job_dir(root, job)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / sweep.DONE).write_text("{}")
    (folder / f"eval-{name}.json").write_text(json.dumps({"data": data, "tau": tau, "tau_decode": tau - 0.05,
                                                          "top1": [0.3, 0.2]}))


def test_the_lr_is_chosen_on_dev_never_on_test(tmp_path):
    jobs = protocol.plan([0, 1], BRACKET, ["speculators"])
    sets = {"dev": "runs/dev", "test": "runs/test"}
    for job, dev, test in zip([j for j in jobs if j.stage == 1 and j.mode == "own"], [1.4, 1.5, 1.45], [1.6, 1.3, 1.3]):
        _score(tmp_path, job, "dev", dev, sets["dev"])
        _score(tmp_path, job, "test", test, sets["test"])
    resolved = protocol.resolve(jobs, sweep.dev_taus(tmp_path, jobs, sets))
    assert [j.lr for j in resolved if j.stage == 2] == [2e-3]
    # a score of another dataset under the dev name is not this dev set's
    assert sweep.dev_taus(tmp_path, jobs, {"dev": "runs/other"}) == {}


def test_dry_run_prints_each_run_its_cost_and_which_peers_are_missing(tmp_path, monkeypatch, capsys):
    home = tmp_path / "peers"
    (home / "speculators" / "bin").mkdir(parents=True)
    py = home / "speculators" / "bin" / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    monkeypatch.setattr(sweep, "PEERS_HOME", home)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    plan = {"tokens": 267_732, "draft_vocab_size": 8192,
            "settings": {"own": {p: defaults.own(p) for p in defaults.PEERS},
                         "shared": {p: defaults.shared(p, 8192, 2, 3, None) for p in defaults.PEERS}}}
    (prepared / "plan.json").write_text(json.dumps(plan))
    out = tmp_path / "out"
    done = protocol.Job("speculators", "shared", 2e-3, 0)
    _score(out, done, "dev", 1.5, str(tmp_path))
    argv = ["--dry-run", "--prepared", str(prepared), "--out", str(out), "--config",
            str(ROOT / "configs" / "smollm2" / "eagle3-1k5.yaml"), "--eval", f"dev={tmp_path}"]
    assert sweep.main(argv) == 0
    text = capsys.readouterr().out
    lines = {line.split()[0]: line for line in text.splitlines() if line and not line.startswith(" ")}
    assert "to run" in lines["headway-recipe-lrown-s0"] and "to run" in lines["speculators-own-lr0.001-s0"]
    assert "scored" in lines[done.name]
    assert "waits for stage 1" in lines["speculators-own-lrbest-s1"]
    for peer in ("modelopt", "specforge"):
        assert "NOT INSTALLED" in lines[f"{peer}-own-lrown-s0"] and f"setup_venvs.sh {peer}" in lines[f"{peer}-own-lrown-s0"]
    # speculators at its own 20 epochs costs ten times its 2-epoch shared run (same vocabulary factor aside)
    cost = {name: float(line.split()[2]) for name, line in lines.items() if name.count("-") == 3}
    assert cost["speculators-shared-lr0.002-s0"] == pytest.approx(28.0)
    assert cost["speculators-own-lr0.001-s0"] > 10 * cost["speculators-shared-lr0.002-s0"]
    assert "22 of 23 runs left" in text
    assert not (out / "peers.json").exists()  # a dry run writes nothing


def test_cost_factor_is_one_at_the_shared_settings_and_grows_with_ttt_vocab_and_layer():
    for peer in defaults.PEERS:
        assert protocol.cost_factor(peer, defaults.shared(peer, 8192, 2, 3, None), 3, 8192) == pytest.approx(1.0)
    own = defaults.own("specforge")  # TTT 7, 32,000 draft tokens
    assert protocol.cost_factor("specforge", own, 7, 8192) > 7 / 3 * 1.5
    assert (protocol.cost_factor("modelopt", defaults.own("modelopt"), 3, 8192)
            > protocol.cost_factor("speculators", defaults.own("speculators"), 3, 8192))  # its 8B-sized layer


def test_own_mode_minutes_come_from_the_measured_own_throughput():
    # one own epoch of the reference tokens at the rates measured alone on 2 threads: SpecForge 153.9 tok/s
    # (29 min on 2 cores: 58 core-minutes), ModelOpt 89.0 (50 min: 100); the shared mode keeps its scaled rate
    tokens = protocol.REFERENCE_TOKENS
    for peer, core_min in (("specforge", 58.0), ("modelopt", 100.3)):
        job = protocol.Job(peer, "own", None, 0)
        assert protocol.cpu_minutes(job, defaults.own(peer), tokens, 8192, 2) == pytest.approx(core_min, rel=0.01)
        two = defaults.own(peer, epochs_cap=None)
        two["options"][defaults.option(peer, "epochs")] = 2
        assert protocol.cpu_minutes(job, two, tokens, 8192, 2) == pytest.approx(2 * core_min, rel=0.01)
    shared = protocol.Job("modelopt", "shared", None, 0)
    assert protocol.cpu_minutes(shared, defaults.shared("modelopt", 8192, 2, 3, None), tokens, 8192, 2) == \
        pytest.approx(2 * protocol.CPU_MIN_PER_EPOCH["modelopt"])


# ---- resumption

def test_a_finished_run_is_skipped_and_an_unfinished_one_runs(tmp_path):
    jobs = [protocol.Job("speculators", "own", 1e-3, 0), protocol.Job("speculators", "own", 1e-3, 1)]
    (sweep.job_dir(tmp_path, jobs[0])).mkdir(parents=True)
    (sweep.job_dir(tmp_path, jobs[0]) / sweep.DONE).write_text("{}")
    started = []

    def command_of(job, folder):
        started.append(job.name)
        return [sys.executable, "-c", f"open({str(folder / sweep.DONE)!r}, 'w').write('{{}}')"]

    assert sweep.run_jobs(jobs, tmp_path, command_of, 1, say=lambda _: None) == []
    assert started == [jobs[1].name]
    assert sweep.run_jobs(jobs, tmp_path, command_of, 1, say=lambda _: None) == []
    assert started == [jobs[1].name]  # the second invocation starts nothing


def test_a_run_that_exits_without_done_json_failed(tmp_path):
    job = protocol.Job("modelopt", "own", None, 0)
    failed = sweep.run_jobs([job], tmp_path, lambda j, f: [sys.executable, "-c", "pass"], 1, say=lambda _: None)
    assert failed == [job] and not sweep.finished(tmp_path, job)


# ---- the spread over seeds

def test_spread_is_mean_sample_std_min_max():
    s = protocol.spread([1.0, 2.0, 3.0])
    assert (s["mean"], s["std"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 1.0, 3.0, 3)
    assert protocol.spread([1.5])["std"] == 0.0
    with pytest.raises(ValueError):
        protocol.spread([])


def test_aggregate_averages_the_seeds_of_one_setting_only():
    a = [protocol.Job("speculators", "own", 2e-3, s) for s in (0, 1, 2)]
    b = protocol.Job("speculators", "own", 4e-3, 0)
    c = protocol.Job("speculators", "shared", 2e-3, 0)
    res = lambda tau: {"dev": {"tau": tau, "tau_decode": tau, "top1": [tau / 4]}}  # noqa: E731
    summary = protocol.aggregate([(a[0], res(1.4)), (a[1], res(1.5)), (a[2], res(1.6)), (b, res(1.0)),
                                  (c, {"dev": {"tau": 1.2}, "test": {"tau": 1.1}})], ["dev", "test"])
    row = summary["speculators own lr 0.002"]
    assert row["seeds"] == [0, 1, 2] and row["dev"]["tau"]["mean"] == pytest.approx(1.5)
    assert row["dev"]["tau"]["std"] == pytest.approx(0.1) and "test" not in row
    assert summary["speculators own lr 0.004"]["dev"]["tau"]["n"] == 1
    assert summary["speculators shared lr 0.002"]["test"]["tau"]["mean"] == 1.1
    md = protocol.markdown(summary, ["dev", "test"])
    assert "| speculators own lr 0.002 | 0,1,2 | 1.500 ± 0.100 (n=3) |" in md
    assert md.count("\n") == 2 + 3


# ---- throughput: one timing method for every tool

def test_every_tool_is_timed_by_the_same_wall_clock_with_the_same_threads_and_cores(tmp_path):
    """A fake process takes 10 s + 2 s a step for every tool: each tool then reads 2 s a step, and each
    ran pinned to the same cores with the same thread count; nothing but the timer's clock counts."""
    clock = [0.0]
    calls = []

    def fake_run(argv, stdout, stderr, env):
        steps = int(next(a for a in argv if "max_steps=" in a).split("=")[1])
        calls.append((tuple(argv[:3]), env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]))
        clock[0] += 10 + 2 * steps
        return argparse.Namespace(returncode=0)

    timer = functools.partial(throughput.time_run, run=fake_run, clock=lambda: clock[0])
    args = throughput.parse_args(["--prepared", str(tmp_path), "--out", str(tmp_path / "t"), "--steps", "4", "12"])
    plan = {"tokens": 12 * 8192, "rows": 500,  # speculators' 12 steps of 8,192 packed tokens fit in one epoch
            "settings": {"own": {p: defaults.own(p) for p in defaults.PEERS}}}
    got = {tool: throughput.measure(tool, args, plan, 16, [0, 1], timer=timer, quiet=lambda *a: 0.1)
           for tool in defaults.TOOLS}
    # one step more than its one epoch holds is refused before anything runs
    calls_before = len(calls)
    with pytest.raises(SystemExit, match="does not fit in one epoch"):
        throughput.measure("speculators", args, dict(plan, tokens=11 * 8192), 16, [0, 1], timer=timer,
                           quiet=lambda *a: 0.1)
    assert len(calls) == calls_before
    assert {tool: r["steady_s_per_step"] for tool, r in got.items()} == {t: 2.0 for t in defaults.TOOLS}
    assert {tool: r["runs"][4]["wall_s"] for tool, r in got.items()} == {t: 18.0 for t in defaults.TOOLS}
    assert set(calls) == {(("taskset", "-c", "0,1"), "2", "2")}
    assert len(calls) == 3 * len(defaults.TOOLS)  # a warm-up run, then the two timed ones
    # a second invocation reuses the timings; an interrupted one is refused
    assert throughput.timed("headway", args, 4, [0, 1], timer=None, quiet=None)["wall_s"] == 18.0
    (tmp_path / "t" / "modelopt" / "steps-4" / "timing.json").unlink()
    with pytest.raises(SystemExit, match="interrupted timing"):
        throughput.timed("modelopt", args, 4, [0, 1], timer=timer, quiet=lambda *a: 0.1)


@pytest.mark.parametrize("warmup,want", [(1, 2.0), (0, 2.0 - 30 / 8)])
def test_a_warm_up_run_keeps_a_cold_first_start_out_of_the_steady_rate(tmp_path, warmup, want):
    """The first process of a tool starts 30 s slower (disk reads, compile caches): with a warm-up run
    both timed runs start warm and the steady rate is the steps' 2 s; without it the cold start lands in
    the 4-step run and the difference reads 30 s / 8 steps too little."""
    clock, started = [0.0], []

    def fake_run(argv, stdout, stderr, env):
        steps = int(next(a for a in argv if "max_steps=" in a).split("=")[1])
        clock[0] += 10 + 2 * steps + (30 if not started else 0)
        started.append(steps)
        return argparse.Namespace(returncode=0)

    timer = functools.partial(throughput.time_run, run=fake_run, clock=lambda: clock[0])
    args = throughput.parse_args(["--prepared", str(tmp_path), "--out", str(tmp_path / "t"), "--steps", "4", "12",
                                  "--warmup", str(warmup)])
    got = throughput.measure("specforge", args, {"tokens": 1000, "rows": 10,
                                                 "settings": {"own": {"specforge": defaults.own("specforge")}}},
                             16, [0, 1], timer=timer, quiet=lambda *a: 0.1)
    assert got["steady_s_per_step"] == pytest.approx(want)
    assert started == [4] * warmup + [4, 12]
    # timings already recorded are not warmed up again
    throughput.measure("specforge", args, {"tokens": 1000, "rows": 10,
                                           "settings": {"own": {"specforge": defaults.own("specforge")}}},
                       16, [0, 1], timer=timer, quiet=lambda *a: 0.1)
    assert started == [4] * warmup + [4, 12]


@pytest.mark.parametrize("tool", ["headway", "speculators", "modelopt", "specforge"])
def test_throughput_runs_each_tool_in_its_own_defaults_for_n_steps(tool, tmp_path):
    args = throughput.parse_args(["--prepared", str(tmp_path), "--out", str(tmp_path / "t")])
    argv = throughput.command(tool, args, tmp_path / "f", 7)
    assert f"{defaults.option(tool, 'max_steps')}=7" in argv
    # speculators would go on through its epochs after max_steps: one epoch ends it
    assert (f"{defaults.option(tool, 'epochs')}=1" in argv) == (tool == "speculators")
    if tool != "headway":
        assert argv[argv.index("--defaults") + 1] == "own"
