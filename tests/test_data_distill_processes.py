"""End to end, in subprocesses: kill -9 mid-run then resume; two processes equal one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from headway.data.distill import DistillConfig, distill, load_distilled
from headway.data.features import FeaturesConfig, FeatureStore, features
from headway.testing import save_tiny_target

PROMPTS = ["def add(a, b):", "import os\nimport sys", "for i in range(10):", "x = [1, 2, 3]\nprint(",
           "def main():\n    parser =", "while True:", "class A(object):", "return self._cache[",
           "with open(path) as f:", "try:\n    import json", "if __name__ ==", "@property\ndef name(self):"]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": PROMPTS[i % len(PROMPTS)] + "  " * (i // len(PROMPTS))}) + "\n"
                            for i in range(n)))
    return path


def args_of(cfg: DistillConfig) -> list[str]:
    return [cfg.source, "--output", cfg.output, "--target", cfg.target, "--max-new-tokens", str(cfg.max_new_tokens),
            "--batch-size", str(cfg.batch_size), "--shard-size", str(cfg.shard_size)]


@pytest.mark.slow
def test_kill_9_after_the_first_shard_then_resume_equals_an_uninterrupted_run(tmp_path):
    # 8 layers and 48 answers of up to 48 tokens: 12 shards, seconds of work after the first one.
    target = save_tiny_target(tmp_path / "deep", "llama", num_hidden_layers=8)
    src = write_prompts(tmp_path / "p.jsonl", 48)
    cfg = DistillConfig(source=str(src), output=str(tmp_path / "killed"), target=str(target), max_new_tokens=48,
                        batch_size=4, shard_size=4)
    cmd = [sys.executable, "-m", "headway", "distill", *args_of(cfg)]
    log = (tmp_path / "log.txt").open("w")
    proc = subprocess.Popen(cmd, env=env(), stdout=log, stderr=log)
    first = tmp_path / "killed" / "shards" / "shard-00000"
    deadline = time.time() + 120
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "log.txt").read_text()[-2000:]
    done = [p.name for p in (tmp_path / "killed" / "shards").iterdir() if ".tmp" not in p.name]
    assert 1 <= len(done) < 12 and not (tmp_path / "killed" / "state.json").exists()

    resumed = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr

    torch.set_num_threads(1)
    reference = distill(DistillConfig(**{**cfg.__dict__, "output": str(tmp_path / "whole")}))
    assert load_distilled(tmp_path / "killed").to_list() == load_distilled(reference).to_list()


@pytest.mark.slow
def test_two_processes_equal_one_process(llama_dir, tmp_path):
    src = write_prompts(tmp_path / "p.jsonl", 20)
    cfg = DistillConfig(source=str(src), output=str(tmp_path / "two"), target=str(llama_dir), max_new_tokens=16,
                        batch_size=3, shard_size=4)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    e = {**env(), "ACCELERATE_USE_CPU": "1"}  # `--cpu --num_processes 2` would silently run one process
    kept = ["--features", str(tmp_path / "two-f"), "--feature-layers", "final", "1", "--feature-store-dtype", "float32"]
    run = subprocess.run([*launch, "-m", "headway", "distill", *args_of(cfg), *kept], env=e, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((tmp_path / "two" / "headway_distill.json").read_text())
    assert manifest["world_size"] == 2 and manifest["shards_by_rank"] == {"0": 3, "1": 2}

    torch.set_num_threads(1)
    one = distill(DistillConfig(**{**cfg.__dict__, "output": str(tmp_path / "one")}))
    two_rows, one_rows = load_distilled(tmp_path / "two").to_list(), load_distilled(one).to_list()
    assert {json.dumps(r) for r in two_rows} == {json.dumps(r) for r in one_rows}
    assert two_rows == one_rows  # rows are even in the same order

    fargs = ["--output", str(tmp_path / "f2"), "--layers", "final", "1", "--store-dtype", "float32",
             "--shard-size", "6", "--batch-size", "4"]
    run = subprocess.run([*launch, "-m", "headway", "features", str(tmp_path / "two"), *fargs], env=e,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    f1 = features(FeaturesConfig(dataset=str(one), output=str(tmp_path / "f1"), layers=["final", "1"],
                                 store_dtype="float32", shard_size=6, batch_size=4))
    a, b = FeatureStore(f1), FeatureStore(tmp_path / "f2")
    kept = FeatureStore(tmp_path / "two-f")  # both processes' shards, kept while they distilled
    assert len(a) == len(b) == len(kept) == 20
    for i in range(len(a)):
        for k, v in a[i].items():
            torch.testing.assert_close(b[i][k], v, rtol=0, atol=1e-6)
            torch.testing.assert_close(kept[i][k], v, rtol=1e-5, atol=1e-5)
