"""benchmarks/tau_needed.py: break-even τ and projected speedups from a bench of random-weight heads."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tau_needed.py"
spec = importlib.util.spec_from_file_location("tau_needed", SCRIPT)
tau_needed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tau_needed)


def method(name, tok_s, tree=None, tau=1.0, speedup=None, new_tokens=100):
    return {"name": name, "tree": tree, "temperature": 0.0, "tokens_per_s": tok_s, "tau": tau, "speedup": speedup,
            "new_tokens": new_tokens, "target_forwards": round(new_tokens / tau), "time_target_share": 0.8,
            "time_drafter_share": 0.15, "overhead_share": 0.05}


REPORT = {"settings": {"target": "t", "threads": 2},
          "methods": [method("hf-generate", 20.0), method("hf-weight-major", 40.0),
                      method("eagle3[dynamic-4-2-8]", 10.0, tree="dynamic-4-2-8")]}  # 100 ms a step, HF 50 ms


def test_break_even_and_projection():
    header, weight_major, tree = tau_needed.rows(REPORT, 1.3, {"dynamic-4-2-8": 3.0})
    assert weight_major[-1] == "2.00x"
    assert tree[1] == "100.0" and tree[3] == "2.00" and tree[4] == "2.60"  # τ 2 breaks even, 2.6 for 1.3x
    assert tree[5] == "3 -> 1.50x"


def test_check_sets_measured_beside_projected():
    trained = {"methods": [method("hf-generate", 21.0),
                           method("eagle3[dynamic-4-2-8]", 21.0, tree="dynamic-4-2-8", tau=2.1, speedup=1.02)]}
    assert tau_needed.check(REPORT, trained)[1] == ["eagle3[dynamic-4-2-8]", "2.10", "1.02x", "1.05x"]


def test_cli_prints_both_tables(tmp_path, capsys):
    (tmp_path / "r.json").write_text(json.dumps(REPORT))
    (tmp_path / "t.json").write_text(json.dumps({"methods": [method("eagle3[x]", 30.0, tree="dynamic-4-2-8", tau=2.0,
                                                                     speedup=1.0)]}))
    assert tau_needed.main([str(tmp_path / "r.json"), "--check", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "HF generate 50.0 ms/token" in out and "1.00x" in out
