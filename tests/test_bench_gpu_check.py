"""benchmarks/gpu_check.py --dry-run: the 8B-shaped speed section's code on CPU, tiny geometry."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_the_report(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--tau", "2.5"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    big = report["big"]
    assert sorted(map(int, big["verify_cost_ratio"])) == list(range(1, 9))
    assert big["hf_greedy_tokens_per_s"] > 0
    assert set(big["decoder"]) == {"medusa/chain-3/dynamic", "medusa/chain-3/static",
                                   "eagle3/dynamic-4-3-8/dynamic", "eagle3/dynamic-4-3-8/static"}
    for row in big["decoder"].values():
        assert row["draft_ms"] >= 0 and row["verify_ms"] > 0 and set(row["projected_speedup"]) == {"2.5"}
