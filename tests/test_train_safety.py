"""Bad input never passes silently (training side): non-finite losses, gradients and features stop
training in one line naming the step; a run folder belongs to one run and one writer; resumed runs
count every token; nonsense numbers are refused at load; published folders follow the umask."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from headway.cli import main
from headway.config import ConfigError, load_config
from headway.data.errors import DataError
from headway.data.features import FeaturesConfig, features
from headway.heads import load_heads
from headway.target import load_target
from headway.testing import save_tiny_target
from headway.train.checkpoints import RUN_FILE, complete_checkpoints
from headway.train.config import TrainConfig
from headway.train.loaders import EpochView
from headway.train.errors import NonFiniteError, TrainError
from headway.train.runlog import RunLog
from headway.train.recipe import fit, train
from headway.train.guards import non_finite_weight
from headway.train.metrics import json_safe

from train_utils import REPO, distilled_rows, save_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on a shared 2-core machine

N_ROWS, BAD_TOKEN = 48, 383  # rows draw tokens from 3..379, so token 383 appears only where we put it
BAD_POSITION = 9  # data-order position of the poisoned row: batch 3 of 4 rows, i.e. optimiser step 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, a copy of it whose embedding of BAD_TOKEN is NaN, and data where BAD_TOKEN
    sits in the one row that training reads at step 3 (its hidden states alone turn NaN)."""
    root = tmp_path_factory.mktemp("safety")
    target = save_tiny_target(root / "target")
    rows = [{**r, "index": i} for i, r in enumerate(distilled_rows(N_ROWS, 380, seed=1))]
    bad_row = EpochView(list(range(N_ROWS)), seed=0, epochs=1)[BAD_POSITION]
    rows[bad_row]["input_ids"][1] = BAD_TOKEN
    data = save_rows(root / "data", rows)
    other = save_rows(root / "other", distilled_rows(16, 380, seed=7))
    return SimpleNamespace(root=root, target=target, nan_target=nan_embedding(target, root / "nan-target"),
                           data=data, other=other, bad_row=bad_row)


def nan_embedding(src: Path, dst: Path) -> Path:
    """A copy of the target whose input embedding of BAD_TOKEN is NaN (one poisoned weight row)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(str(dst))
    with torch.no_grad():
        model.get_input_embeddings().weight[BAD_TOKEN] = float("nan")
    model.save_pretrained(str(dst))
    return dst


def config(s, out: Path, **kw) -> TrainConfig:
    base = {"target": str(s.target), "data": str(s.data), "output_dir": str(out), "batch_size": 4, "max_steps": 5,
            "log_every": 1, "save_every": 1, "keep_checkpoints": 0, "eval_fraction": 0.0, "progress": False,
            "medusa.num_heads": 2, "optim.lr": 3e-3}
    return load_config(TrainConfig, None, {**base, **kw})


def strict_records(path: Path) -> list[dict]:
    """log.jsonl read as strict JSON: a bare NaN / Infinity fails."""
    def refuse(name):
        raise ValueError(f"{path} holds a bare {name}: not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def assert_checkpoints_finite(out: Path) -> None:
    from safetensors.torch import load_file

    for _, ckpt in complete_checkpoints(out):
        for name, t in load_file(str(ckpt / "model.safetensors")).items():
            assert torch.isfinite(t).all(), f"{ckpt.name}: {name} is not finite"


# -- 1. non-finite guards ----------------------------------------------------------------------
def test_a_nan_target_weight_stops_training_at_its_step_and_writes_no_heads(setup, tmp_path):
    target, tok = load_target(str(setup.nan_target), device="cpu")
    with pytest.raises(NonFiniteError) as e:
        fit(config(setup, tmp_path), target, tok)
    msg = str(e.value)
    assert "\n" not in msg and "step 3" in msg and "hidden states" in msg and "dtype=" in msg, msg
    assert not (tmp_path / "final").exists()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2]  # saved before the NaN, nothing after
    assert_checkpoints_finite(tmp_path)
    log = strict_records(tmp_path / "log.jsonl")
    assert log[-1]["event"] == "non_finite" and log[-1]["step"] == 3
    assert [r["step"] for r in log if "loss" in r] == [1, 2]


def test_the_cli_prints_the_non_finite_stop_on_one_line(setup, tmp_path, capsys):
    rc = main(["train", f"target={setup.nan_target}", f"data={setup.data}", f"output_dir={tmp_path}", "batch_size=4",
               "max_steps=5", "save_every=0", "eval_fraction=0", "progress=false", "medusa.num_heads=2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err.startswith("headway train: error: training stopped at step 3: ") and "NaN" in err
    assert not (tmp_path / "final").exists() and not complete_checkpoints(tmp_path)


def test_nan_stored_features_stop_offline_training_naming_them(setup, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    feats = features(FeaturesConfig(dataset=str(setup.data), output=str(tmp_path / "feat"), target=str(setup.target),
                                    layers=["final"], store_dtype="float32", batch_size=8, shard_size=16))
    j, r = divmod(setup.bad_row, 16)  # poison the stored 'final' state of the row read at step 3
    shard = feats / f"shard-{j:05d}.safetensors"
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    a, b = tensors["offsets"][r: r + 2].tolist()
    tensors["final"][a + 2: b] = float("nan")
    save_file(tensors, str(shard), metadata=meta)

    target, tok = load_target(str(setup.target), device="cpu")
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as e:
        fit(config(setup, out, data="", features=str(feats)), target, tok)
    msg = str(e.value)
    assert "\n" not in msg and "step 3" in msg and f"stored features 'final' in {feats}" in msg, msg
    assert not (out / "final").exists()
    assert_checkpoints_finite(out)


def test_features_refuse_to_store_non_finite_hidden_states_naming_the_row(setup, tmp_path, capsys):
    out = tmp_path / "feat"
    with pytest.raises(DataError) as e:
        features(FeaturesConfig(dataset=str(setup.data), output=str(out), target=str(setup.nan_target),
                                layers=["final"], store_dtype="float32", batch_size=8, shard_size=16))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"dataset row {setup.bad_row}: ") and "NaN/inf" in msg, msg
    assert not (out / f"shard-{setup.bad_row // 16:05d}.safetensors").exists()
    # float16 storage of states beyond its range is an overflow, said so
    from headway.data.features import check_finite_row

    big = torch.full((3, 4), 1e6)
    with pytest.raises(DataError, match=r"dataset row 5: .* overflow --store_dtype float16"):
        check_finite_row(big.half(), big, "final", 5)


def test_logs_and_states_stay_strict_json(tmp_path):
    assert json_safe({"a": float("nan"), "b": [1.0, float("inf"), -float("inf")], "c": (2, "x")}) == \
        {"a": None, "b": [1.0, None, None], "c": [2, "x"]}
    acc = SimpleNamespace(is_main_process=True, log=lambda *a, **k: None)
    RunLog(acc, tmp_path / "log.jsonl", None).write({"step": 1, "eval": {"tau": float("nan")}, "loss": float("inf")})
    assert strict_records(tmp_path / "log.jsonl") == [{"step": 1, "eval": {"tau": None}, "loss": None}]


def test_weights_are_checked_before_they_are_saved():
    m = torch.nn.Module()
    m.a, m.b, m.frozen = (torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2)),
                          torch.nn.Parameter(torch.full((1,), float("nan")), requires_grad=False))
    assert non_finite_weight(m) is None  # a frozen weight is not the heads'
    with torch.no_grad():
        m.b[1, 0] = float("inf")
    assert non_finite_weight(m) == "b"


# -- 2. a run folder belongs to one run, and one writer -----------------------------------------
def test_a_folder_of_another_run_is_refused_before_the_target_loads(setup, tmp_path, monkeypatch):
    train(config(setup, tmp_path, max_steps=1))
    assert json.loads((tmp_path / RUN_FILE).read_text())["run"]["data"] == str(setup.data)

    import headway.target

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the refusal")

    with monkeypatch.context() as m:
        m.setattr(headway.target, "load_target", no_load)
        for kw in ({"data": str(setup.other)}, {"kind": "eagle1"}):
            with pytest.raises(TrainError) as e:
                train(config(setup, tmp_path, max_steps=1, **kw))
            msg = str(e.value)
            assert "\n" not in msg and f"output_dir {tmp_path} holds another run" in msg, msg
            assert "new output_dir" in msg and "overwrite=true" in msg and "resume_from=latest" in msg
        (tmp_path / RUN_FILE).unlink()  # a folder from before run.json: its newest checkpoint says whose it is
        with pytest.raises(TrainError, match="'data' was"):
            train(config(setup, tmp_path, max_steps=1, data=str(setup.other)))

    # the same run resumes; overwrite=true replaces the other run's outputs, keeping other files
    assert load_heads(train(config(setup, tmp_path, max_steps=1, resume_from="latest"))).metadata["training"]["data"] \
        == str(setup.data)
    (tmp_path / "notes.txt").write_text("mine")
    final = train(config(setup, tmp_path, max_steps=1, data=str(setup.other), overwrite=True))
    assert load_heads(final).metadata["training"]["data"] == str(setup.other)
    assert [r["event"] for r in strict_records(tmp_path / "log.jsonl") if "event" in r] == ["start", "done"]
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1] and (tmp_path / "notes.txt").read_text() == "mine"


HOLD_LOCK = """
import sys, time
from pathlib import Path
from headway.locking import output_lock
with output_lock(Path(sys.argv[1]), RuntimeError):
    print("locked", flush=True)
    time.sleep(300)
"""


@pytest.fixture
def locked_by_another_process():
    """Hold a folder's writer lock from another process (started and ended here, by its pid)."""
    procs = []

    def hold(folder: Path) -> int:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True,
                             env=env)
        procs.append(p)
        assert p.stdout.readline().strip() == "locked"
        return p.pid

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def test_a_second_writer_into_a_run_folder_is_refused(setup, tmp_path, locked_by_another_process):
    pid = locked_by_another_process(tmp_path)
    target, tok = load_target(str(setup.target), device="cpu")
    with pytest.raises(TrainError) as e:
        fit(config(setup, tmp_path, max_steps=1), target, tok)
    assert str(e.value) == (f"{tmp_path} is being written by another headway process (pid {pid}); wait for it to "
                            "finish, or choose another output folder")
    assert not (tmp_path / "log.jsonl").exists() and not (tmp_path / RUN_FILE).exists()


# -- 3. resumed runs count every token -----------------------------------------------------------
def test_a_resumed_run_reports_the_tokens_of_an_uninterrupted_one(setup, tmp_path):
    kw = {"max_steps": 8, "log_every": 4, "save_every": 3}  # checkpoint 3 falls between two log steps
    full = train(config(setup, tmp_path / "full", **kw))
    part = tmp_path / "part"
    train(config(setup, part, stop_after=5, **kw))
    shutil.rmtree(part / "checkpoints" / "checkpoint-5")  # killed after step 5: checkpoint 3 is the latest
    resumed = train(config(setup, part, resume_from="latest", **kw))

    tokens = [load_heads(p).metadata["training"]["tokens"] for p in (full, resumed)]
    assert tokens[0] == tokens[1] > 0
    logged = [[r["tokens"] for r in strict_records(p / "log.jsonl") if "tokens" in r] for p in (full.parent, part)]
    assert logged[0] == logged[1]


# -- 4. nonsense numbers are refused at load -------------------------------------------------------
@pytest.mark.parametrize("override, message", [
    ("epochs=-3", "'epochs' must be a finite number > 0, got -3.0"),
    # #46: 0 steps saved freshly initialised heads as `final`, which looked like a finished run
    ("max_steps=0", "'max_steps' must be >= 1, got 0"),
    ("max_length=-1", "'max_length' must be >= 1, got -1"),
    ("optim.lr=.nan", "'optim.lr' must be a finite number > 0, got nan"),
    ("optim.lr=.inf", "'optim.lr' must be a finite number > 0, got inf"),
    ("batch_size=0", "'batch_size' must be >= 1, got 0"),
    ("grad_accum=0", "'grad_accum' must be >= 1, got 0"),
    ("optim.warmup_steps=-5", "'optim.warmup_steps' must be >= 0, got -5"),
    ("optim.max_grad_norm=-1", "'optim.max_grad_norm' must be a finite number >= 0, got -1.0"),
    ("log_every=0", "'log_every' must be >= 1, got 0"),
    ("medusa.decay=.nan", "'medusa.decay' must be a finite number > 0, got nan"),
    ("eagle.noise=-0.1", "'eagle.noise' must be a finite number >= 0, got -0.1"),
    ("lora.dropout=1.5", "'lora.dropout' must be a finite number in [0, 1), got 1.5"),
])
def test_nonsense_numbers_are_refused_at_load_naming_the_key_and_rule(override, message, capsys):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, ["target=demo", override])
    assert str(e.value) == message
    assert main(["train", "--target", "demo", override, "data=/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"headway train: error: {message}"


# -- 5. published folders follow the umask --------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_run_folders_are_readable_per_umask(setup, tmp_path, umask):
    old = os.umask(umask)
    try:
        final = train(config(setup, tmp_path / "run", max_steps=1))
    finally:
        os.umask(old)
    out = tmp_path / "run"
    dirs = [out, final, out / "checkpoints", *(p for p in final.rglob("*") if p.is_dir()),
            *(p for _, p in complete_checkpoints(out))]
    for d in dirs:
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask, f"{d}: {oct(stat.S_IMODE(d.stat().st_mode))}"
    for f in [*final.rglob("*"), out / "log.jsonl", out / RUN_FILE]:
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f"{f}: {oct(stat.S_IMODE(f.stat().st_mode))}"
