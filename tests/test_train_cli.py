"""`headway train` as a command: YAML + overrides, trackers, and 2-process DDP on CPU."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from headway.cli import main
from headway.heads import load_heads
from headway.testing import save_tiny_target

from train_utils import distilled_rows, free_port, records, run_cli, save_rows

YAML = """\
target: {target}
data: {data}
max_steps: 4
batch_size: 2
log_every: 1
save_every: 2
eval_fraction: 0.25
progress: false
medusa:
  num_heads: 2
lora:
  r: 4
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_cli")
    target = save_tiny_target(root / "target")
    # equal-length, fully supervised rows: every process averages over the same token count,
    # so the 2-process mean of means equals the 1-process mean
    data = save_rows(root / "data", distilled_rows(40, 384, seed=2, uniform=True, max_len=16))
    (root / "c.yaml").write_text(YAML.format(target=target, data=data))
    return root




def test_cli_with_wandb_offline(workdir, tmp_path):
    out = tmp_path / "wb"
    r = run_cli(["train", "--config", str(workdir / "c.yaml"), f"output_dir={out}", "report_to=wandb",
                 "run_name=cli-test"], workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs, f"no wandb offline run under {out / 'wandb'}"
    assert any(runs[0].rglob("*.wandb"))
    assert load_heads(out / "final").config.num_heads == 2
    assert "done:" in r.stdout


def test_cli_wandb_respects_wandb_dir(workdir, tmp_path):
    out, mine = tmp_path / "wb", tmp_path / "mine"
    r = run_cli(["train", "--config", str(workdir / "c.yaml"), f"output_dir={out}", "report_to=wandb", "max_steps=2",
                 "save_every=0"], workdir, extra_env={"WANDB_DIR": str(mine)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((mine / "wandb").glob("offline-run-*")) and not (out / "wandb").exists()


def test_cli_errors_are_one_line(workdir, capsys):
    assert main(["train", "--config", str(workdir / "c.yaml"), "data=/nonexistent/data"]) == 2
    err = capsys.readouterr().err
    assert "training data not found: /nonexistent/data" in err and len(err.strip().splitlines()) == 1
    assert main(["train", "--config", str(workdir / "c.yaml"), "optim.lrr=1"]) == 2
    assert "Did you mean 'optim.lr'" in capsys.readouterr().err


def test_tensorboard_tracker(workdir, tmp_path):
    out = tmp_path / "tb"
    torch.set_num_threads(1)
    assert main(["train", "--config", str(workdir / "c.yaml"), f"output_dir={out}", "report_to=tensorboard",
                 "max_steps=2"]) == 0
    assert list((out / "logs").rglob("events.out.tfevents.*"))


@pytest.mark.slow
# One kind per distinct distributed path (each run costs ~30 s of two accelerate processes): Medusa-2
# trains the heads with Medusa-1's loss plus LoRA on the target, so its run covers Medusa-1's path
# (heads on a frozen target, as in test_train_eagle's eagle3 run) and the trainable-target one.
@pytest.mark.parametrize("kind", ["medusa2"])
def test_two_processes_match_one_process(workdir, tmp_path, kind):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate, "accelerate launcher not installed next to this python"
    args = ["--config", str(workdir / "c.yaml"), f"kind={kind}"]
    one = run_cli(["train", *args, f"output_dir={tmp_path / 'one'}", "batch_size=4"], workdir)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(args + [f"output_dir={tmp_path / 'two'}", "batch_size=2"], workdir, timeout=300,
                  launcher=[accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                            "-m", "headway", "train"],
                  extra_env={"ACCELERATE_USE_CPU": "1"})
    assert two.returncode == 0, two.stderr[-3000:]

    start1, start2 = records(tmp_path / "one")[0], records(tmp_path / "two")[0]
    assert start1["world_size"] == 1 and start2["world_size"] == 2
    assert start1["global_batch"] == start2["global_batch"] == 4
    l1 = [r["loss"] for r in records(tmp_path / "one") if "loss" in r]
    l2 = [r["loss"] for r in records(tmp_path / "two") if "loss" in r]
    assert len(l1) == len(l2) == 4
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-4, atol=1e-5)
    h1, h2 = load_heads(tmp_path / "one" / "final"), load_heads(tmp_path / "two" / "final")
    for k, v in h1.state_dict().items():
        torch.testing.assert_close(h2.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    e1, e2 = h1.metadata["eval"], h2.metadata["eval"]
    assert e1["positions"] == e2["positions"] and e1["tau"] == pytest.approx(e2["tau"], abs=1e-3)
    # the resumable checkpoint holds every process's RNG state
    ckpt = tmp_path / "two" / "checkpoints" / "checkpoint-4"
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()
