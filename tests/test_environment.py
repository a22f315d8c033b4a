"""The environment variables headway honours: HEADWAY_CACHE (its own cache), HF_HOME /
HF_HUB_CACHE (Hub downloads). WANDB_DIR: tests/test_train_cli.py and test_train_loop.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from headway.demo.configs import TargetBuildConfig
from headway.demo.builder import default_cache_dir, resolve_config, target_dir
from headway.testing import save_tiny_target

REPO = Path(__file__).resolve().parents[1]


def test_headway_cache_holds_built_targets(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "hw"))
    assert default_cache_dir() == tmp_path / "hw"
    assert target_dir(resolve_config(TargetBuildConfig(preset="tiny"))).parent == tmp_path / "hw" / "targets"
    monkeypatch.delenv("HEADWAY_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "headway"


def hub_snapshot(cache: Path, repo_id: str, folder: Path) -> None:
    """``folder`` laid out as huggingface_hub's cache holds a download of ``repo_id``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())


LOAD = """
from headway.target import load_target
model, tok = load_target("someorg/tiny-target")
print(type(model).__name__)
"""


@pytest.mark.parametrize("var", ["HF_HUB_CACHE", "HF_HOME"])
def test_targets_by_repo_id_come_from_the_hub_cache_the_environment_names(tmp_path, var):
    root = tmp_path / "hf"
    hub_snapshot(root / "hub" if var == "HF_HOME" else root, "someorg/tiny-target",
                 save_tiny_target(tmp_path / "target"))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE")}
    env.update({var: str(root), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    r = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "LlamaForCausalLM", r.stderr[-2000:]
    env[var] = str(tmp_path / "empty")  # the same load with another cache finds nothing: it was this one
    r = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
