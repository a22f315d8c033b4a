"""headway adapt end to end on a tiny chat target: a round publishes heads that beat the served ones
(with their lineage, exportable), a rejected round leaves the served heads byte for byte as they
were, a stopped round resumes where it stopped, traffic leaves nothing but the messages in any file,
and --watch runs a round when enough new traffic has arrived and can roll back."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from headway.adapt import generations
from headway.adapt.configs import AdaptConfig
from headway.adapt.errors import AdaptError
from headway.adapt.run import adapt
from headway.adapt.state import RoundState, latest_round
from headway.adapt.watch import watch
from headway.cli import main
from headway.config import load_config
from headway.data.distill import DistillConfig, distill, load_distilled
from headway.heads.metadata import read_metadata
from headway.testing import tiny_target
from headway.train.config import TrainConfig
from headway.train.recipe import train

CHAT = ("{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
WORDS = ["apple", "river", "code", "music", "stone", "cloud", "garden", "number", "letter", "window"]
SECRETS = (b"SECRET", b"10.9.8.7")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target folder, served heads H, prompts file): H are Medusa heads trained one step at a tiny
    learning rate, i.e. about as good as fresh ones, so a round's heads beat them clearly."""
    root = tmp_path_factory.mktemp("adapt")
    for name in ("target", "chatty"):
        model, tok = tiny_target("llama")
        if name == "chatty":  # EOS likely enough that sampled user turns end (--prompts self)
            with torch.no_grad():
                model.get_output_embeddings().weight[1] = 4.0 * model.get_output_embeddings().weight[10]
        tok = copy.deepcopy(tok)  # tiny_tokenizer is cached: the template must not leak into other tests
        tok.chat_template = CHAT
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": f"Tell me about {WORDS[i % 10]} {i}"}) + "\n"
                               for i in range(40)))
    data = distill(DistillConfig(source=str(prompts), target=str(root / "target"), output=str(root / "d0"), limit=8,
                                 max_new_tokens=16, batch_size=8))
    heads = train(load_config(TrainConfig, None, {"target": str(root / "target"), "kind": "medusa", "data": str(data),
                                                  "output_dir": str(root / "H"), "max_steps": 1, "batch_size": 4,
                                                  "optim.lr": 1e-5, "eval_fraction": 0.0, "progress": False}))
    return root / "target", heads, prompts


def config(setup, tmp, **kw) -> AdaptConfig:
    target, heads, prompts = setup
    settings = {"target": str(target), "heads": str(heads), "prompts": str(prompts), "out": str(tmp / "served"),
                "distill.max_new_tokens": 24, "distill.batch_size": 16, "train.max_steps": 20, "train.lr": 1e-2,
                "train.eval_fraction": 0.1, "gate.max_new_tokens": 24, "gate.heldout_fraction": 0.2}
    return load_config(AdaptConfig, None, {**settings, **kw})


def files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and modification time."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_round_publishes_heads_that_beat_the_served_ones_with_their_lineage(setup, tmp_path, capsys):
    cfg = config(setup, tmp_path)
    out = adapt(cfg)
    served = tmp_path / "served"
    assert out.accepted and out.generation == 1 and out.tau_after >= out.tau_before * 1.03
    meta = read_metadata(served)
    lineage = meta["adapt"]
    assert lineage["tau"]["before"] == pytest.approx(out.tau_before, abs=1e-4)
    assert lineage["tau"]["after"] == pytest.approx(out.tau_after, abs=1e-4)
    assert lineage["tau"]["same_output"] is True  # both decoders wrote the target's greedy tokens
    assert lineage["prompts"] == {"source": str(setup[2]), "total": 40, "train": 32, "heldout": 8,
                                  "distilled_rows": 32, "seed": 0}
    compute = lineage["compute"]
    assert compute["distill_tokens"] > 0 and compute["train_tokens"] > 0 and compute["train_steps"] == 20
    assert compute["total_s"] >= compute["distill_s"] + compute["train_s"]
    assert lineage["base_heads"] == str(setup[1]) and lineage["generation"] == 1
    assert meta["init_from"].endswith("round-0001/base")  # continued from the served heads, not from scratch
    card = (served / "README.md").read_text()
    assert "## Adaptation" in card and f"| tau after (these heads) | {out.tau_after:.3f} |" in card
    index = json.loads((tmp_path / "served.adapt" / "generations" / "index.json").read_text())
    assert [g["generation"] for g in index["generations"]] == [0, 1] and index["served"]["generation"] == 1
    gen0 = tmp_path / "served.adapt" / "generations" / "gen-0000"
    assert (gen0 / "model.safetensors").read_bytes() == (setup[1] / "model.safetensors").read_bytes()
    assert (served / "model.safetensors").read_bytes() != (setup[1] / "model.safetensors").read_bytes()

    capsys.readouterr()
    again = adapt(cfg)  # the same round: reported, nothing redone
    assert again.generation == 1 and "already published as generation 1" in capsys.readouterr().out
    assert latest_round(tmp_path / "served.adapt").name == "round-0001"

    assert main(["export", str(served), "--format", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    assert (tmp_path / "vllm" / "config.json").is_file()


def test_a_rejected_round_leaves_the_served_heads_byte_identical(setup, tmp_path, capsys, monkeypatch):
    served = tmp_path / "served"
    shutil.copytree(setup[1], served)
    before = files(served)
    out = adapt(config(setup, tmp_path, threshold=50.0))
    text = capsys.readouterr().out
    assert out.accepted is False and files(served) == before
    assert f"kept the served heads: tau {out.tau_before:.3f} -> {out.tau_after:.3f}" in text
    assert f"{served} was not touched" in text
    assert not (tmp_path / "served.adapt" / "generations").exists()

    state = latest_round(tmp_path / "served.adapt")
    steps = {k: v for k, v in state.steps.items() if k != "decision"}
    with monkeypatch.context() as m:  # killed while publishing: the generations are stored, --out is not written
        m.setattr(generations, "serve", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            adapt(config(setup, tmp_path, threshold=0.0))
    assert files(served) == before
    out = adapt(config(setup, tmp_path, threshold=0.0))  # the same round, a lower bar: published, nothing redone
    text = capsys.readouterr().out
    assert out.accepted and out.generation == 1 and "distill" not in text and "tau" in text
    index = json.loads((tmp_path / "served.adapt" / "generations" / "index.json").read_text())
    assert [g["generation"] for g in index["generations"]] == [0, 1]  # stored once, though published twice
    assert {k: v for k, v in RoundState.read(state.folder).steps.items() if k in steps} == steps
    assert read_metadata(served)["adapt"]["tau"]["threshold"] == 0.0


def test_a_rejected_round_creates_no_served_folder(setup, tmp_path):
    assert adapt(config(setup, tmp_path, threshold=50.0, **{"train.max_steps": 2})).accepted is False
    assert not (tmp_path / "served").exists()


def test_a_stopped_round_resumes_where_it_stopped(setup, tmp_path, capsys):
    work = tmp_path / "served.adapt"
    out = adapt(config(setup, tmp_path, stop_after="distill"))
    state = latest_round(work)
    assert out.stopped == "distill" and list(state.steps) == ["prompts", "before", "distill"]
    assert not (state.folder / "train").exists() and not (tmp_path / "served").exists()
    manifest = (state.folder / "distill" / "headway_distill.json").stat().st_mtime_ns

    with pytest.raises(AdaptError, match=r"unfinished round made with other settings \(distill: .*max_new_tokens"):
        adapt(config(setup, tmp_path, **{"distill.max_new_tokens": 12}))
    out = adapt(config(setup, tmp_path, **{"train.stop_after": 8}))  # training's own stop: a checkpoint, no heads
    assert out.stopped == "train" and (state.folder / "train" / "checkpoints" / "checkpoint-8").is_dir()
    assert not (state.folder / "train" / "final").exists()

    capsys.readouterr()
    out = adapt(config(setup, tmp_path))
    assert out.accepted is not None and "resuming at step 8" in capsys.readouterr().out
    assert (state.folder / "distill" / "headway_distill.json").stat().st_mtime_ns == manifest  # not redone
    log = [json.loads(x) for x in (state.folder / "train" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r.get("event") == "start"] == [0, 8]
    assert read_metadata(state.folder / "train" / "final")["training"]["steps"] == 20

    fresh = adapt(config(setup, tmp_path, overwrite=True, stop_after="prompts", **{"distill.max_new_tokens": 12}))
    assert fresh.round == "round-0002"  # the finished round stays; other settings start the next one


def test_an_unfinished_round_of_other_settings_is_dropped_only_on_overwrite(setup, tmp_path):
    adapt(config(setup, tmp_path, stop_after="prompts"))
    out = adapt(config(setup, tmp_path, overwrite=True, stop_after="prompts", seed=3))
    assert out.round == "round-0001" and latest_round(tmp_path / "served.adapt").data["settings"]["seed"] == 3


def test_a_round_that_finished_no_step_starts_again_with_the_settings_fixed(setup, tmp_path, monkeypatch):
    from headway.adapt.rounds import Round

    with monkeypatch.context() as m:  # the prompts step fails (a template missing, say): no step is recorded
        m.setattr(Round, "prompts", lambda self, rows, info: (_ for _ in ()).throw(AdaptError("no template")))
        with pytest.raises(AdaptError, match="no template"):
            adapt(config(setup, tmp_path, stop_after="prompts"))
    assert latest_round(tmp_path / "served.adapt").steps == {}
    out = adapt(config(setup, tmp_path, stop_after="prompts", seed=3))  # other settings: nothing to lose
    assert out.round == "round-0001" and latest_round(tmp_path / "served.adapt").data["settings"]["seed"] == 3


def test_a_missing_target_is_one_line_before_any_work(setup, tmp_path, capsys):
    argv = ["adapt", "--target", str(tmp_path / "nope"), "--heads", str(setup[1]), "--prompts", str(setup[2]),
            "--out", str(tmp_path / "served")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("headway adapt: error: ") and "nope" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "served.adapt").exists() and not (tmp_path / "served").exists()
    assert main(argv[:2] + [str(setup[0])] + argv[3:] + ["gate.tree=dynamic-0"]) == 2
    assert "headway adapt: error: " in capsys.readouterr().err and not (tmp_path / "served.adapt").exists()


def test_out_holding_anything_but_heads_is_refused_before_any_work(setup, tmp_path):
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "notes.txt").write_text("mine")
    with pytest.raises(AdaptError, match="holds something other than heads"):
        adapt(config(setup, tmp_path))
    assert not (tmp_path / "served.adapt").exists() and (tmp_path / "served" / "notes.txt").read_text() == "mine"


def test_heads_a_round_cannot_continue_are_refused_before_any_work(setup, tmp_path):
    from headway.heads.metadata import update_metadata

    medusa2 = tmp_path / "medusa2"
    shutil.copytree(setup[1], medusa2)
    update_metadata(medusa2, {"adapter": {"subfolder": "adapter"}})
    with pytest.raises(AdaptError, match="Medusa-2"):
        adapt(config(setup, tmp_path, heads=str(medusa2)))
    with pytest.raises(AdaptError, match="is not a headway heads folder"):
        adapt(config(setup, tmp_path, heads=str(tmp_path)))
    assert not (tmp_path / "served.adapt").exists()


def test_the_target_can_write_the_prompts_itself(setup, tmp_path):
    cfg = config(setup, tmp_path, prompts="self", num_prompts=4, stop_after="prompts", target=str(setup[0].parent / "chatty"),
                 **{"self_prompts.batch_size": 16, "self_prompts.max_new_tokens": 16, "self_prompts.min_chars": 4})
    assert adapt(cfg).stopped == "prompts"
    state = latest_round(tmp_path / "served.adapt")
    rows = [json.loads(x) for x in (state.folder / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["id"].startswith("self:") and r["prompt"] for r in rows)
    assert state.steps["prompts"]["source"] == "self" and state.steps["prompts"]["heldout"] == 1


def traffic_rows(start: int, n: int) -> list[dict]:
    """Request logs in the shapes gateways write, carrying ids and fields that must not leave them."""
    rows = []
    for i in range(start, start + n):
        body = {"model": "served", "user": f"user-SECRET-{i}", "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": f"Tell me about {WORDS[i % 10]} {i}", "name": "SECRET-name"}]}
        rows.append([body, {"request": body, "request_id": f"req-SECRET-{i}", "ip": "10.9.8.7"},
                     {"body": json.dumps(body), "headers": {"x-api-key": "SECRET"}}][i % 3])
    return rows


def write_log(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_traffic_leaves_nothing_but_the_messages_in_any_file(setup, tmp_path):
    logs = tmp_path / "logs"
    write_log(logs / "a.jsonl", traffic_rows(0, 20) + traffic_rows(0, 5))  # 5 repeated requests
    out = adapt(config(setup, tmp_path, prompts=f"traffic:{logs}", threshold=0.0, **{"train.max_steps": 3}))
    assert out.accepted is not None
    written = [p for p in (tmp_path / "served.adapt").rglob("*") if p.is_file()]
    written += [p for p in (tmp_path / "served").rglob("*") if p.is_file()]
    leaks = [str(p) for p in written for s in SECRETS if s in p.read_bytes()]
    assert written and leaks == []
    state = latest_round(tmp_path / "served.adapt")
    assert state.steps["prompts"]["traffic"]["unique"] == 20 and state.steps["prompts"]["total"] == 20
    ds = load_distilled(state.folder / "distill")
    assert set(ds.column_names) == {"index", "id", "input_ids", "loss_mask", "finish_reason"}
    assert all(i.startswith("traffic:") and len(i) == 32 for i in ds["id"])


def test_watch_runs_rounds_on_new_traffic_and_rolls_back(setup, tmp_path, capsys):
    logs, served = tmp_path / "logs", tmp_path / "served"
    write_log(logs / "a.jsonl", traffic_rows(0, 12))
    slept: list[float] = []
    times = iter([1000.0, 2000.0, 3000.0])

    def sleep(seconds):
        slept.append(seconds)
        if len(slept) == 2:  # between the second look and the third, new traffic arrives
            write_log(logs / "b.jsonl", traffic_rows(12, 10))

    cfg = config(setup, tmp_path, prompts=None, watch=str(logs), threshold=0.0,
                 **{"traffic.min_new_prompts": 8, "traffic.poll_seconds": 60, "train.max_steps": 10})
    outcomes = watch(cfg, clock=lambda: next(times), sleep=sleep, polls=3)
    assert slept == [60, 60] and [o.round for o in outcomes] == ["round-0001", "round-0002"]
    assert "0 new unique prompts in the window (12 in all); a round starts at 8" in capsys.readouterr().out
    work = tmp_path / "served.adapt"
    assert len(json.loads((work / "watch.json").read_text())["used"]) == 22
    second = RoundState.read(work / "rounds" / "round-0002")
    assert second.data["settings"]["base"] == str(served.resolve())  # the served heads of round 1
    assert second.steps["prompts"]["total"] == 22  # the whole window, not only what is new
    index = json.loads((work / "generations" / "index.json").read_text())
    made = [g["generation"] for g in index["generations"]]
    assert made[:2] == [0, 1] and index["served"]["generation"] == made[-1]

    assert main(["adapt", "--rollback", "0", "--out", str(served)]) == 0
    assert (served / "model.safetensors").read_bytes() == (setup[1] / "model.safetensors").read_bytes()
    assert json.loads((work / "generations" / "index.json").read_text())["served"]["generation"] == 0
    assert main(["adapt", "--rollback", "7", "--out", str(served)]) == 2
    assert "no generation 7" in capsys.readouterr().err

    once = ["adapt", "--watch", str(logs), "--once", "--target", str(setup[0]), "--out", str(served),
            "traffic.min_new_prompts=8"]
    assert main(once) == 0 and "0 new unique prompts" in capsys.readouterr().out


@pytest.mark.slow
def test_a_killed_round_resumes_from_its_last_checkpoint(setup, tmp_path):
    """`headway adapt` killed (SIGKILL, no chance to clean up) while it trains: the same command again
    keeps the distilled answers, resumes training from the last checkpoint and finishes the round."""
    import os
    import signal
    import subprocess
    import sys
    import time

    target, heads, prompts = setup
    args = [sys.executable, "-m", "headway", "adapt", f"target={target}", f"heads={heads}", f"prompts={prompts}",
            f"out={tmp_path / 'served'}", "distill.max_new_tokens=24", "distill.batch_size=16",
            "train.max_steps=400", "train.save_every=5", "train.lr=1e-2", "train.eval_fraction=0.1",
            "gate.max_new_tokens=24", "gate.heldout_fraction=0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    checkpoints = tmp_path / "served.adapt" / "rounds" / "round-0001" / "train" / "checkpoints"
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        # a complete checkpoint: checkpoint-N.tmp is one still being written (a kill then leaves nothing to
        # resume from; CI once hit that window on a busy machine)
        def complete() -> bool:
            return checkpoints.is_dir() and any(p.suffix != ".tmp" for p in checkpoints.glob("checkpoint-*"))

        while not complete() and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
        assert proc.poll() is None, "the round ended before it could be killed: " + (tmp_path / "first.log").read_text()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    state = latest_round(tmp_path / "served.adapt")
    assert "train" not in state.steps and "distill" in state.steps
    manifest = (state.folder / "distill" / "headway_distill.json").stat().st_mtime_ns

    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming at step" in done.stdout
    assert (state.folder / "distill" / "headway_distill.json").stat().st_mtime_ns == manifest  # not redone
    assert read_metadata(state.folder / "train" / "final")["training"]["steps"] == 400
    assert "decision" in latest_round(tmp_path / "served.adapt").steps
