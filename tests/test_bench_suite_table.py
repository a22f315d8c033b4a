"""benchmarks/suite_table.py: per-category tau of `headway eval` reports, seeds pooled into mean ± sd."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "suite_table.py"
spec = importlib.util.spec_from_file_location("suite_table", SCRIPT)
suite_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_table)


def method(heads, qa, math, accepted=(0.3, 0.1)):
    cats = {"qa": {"tau": qa, "accepted_per_depth": list(accepted)},
            "math": {"tau": math, "accepted_per_depth": list(accepted)}}
    return {"name": "m", "heads": heads, "temperature": 0.0, "tau": (qa + math) / 2,
            "accepted_per_depth": list(accepted), "categories": cats}


def report(methods, per_category=8, max_new=128):
    return {"schema": "headway.eval/1", "engine": "headway",
            "suite": {"name": "spec-bench", "per_category": per_category, "seed": 0,
                      "categories": {"qa": {"questions": 8, "prompts": 8}, "math": {"questions": 8, "prompts": 8}}},
            "settings": {"max_new_tokens": max_new},
            "methods": [{"name": "hf-generate", "heads": None, "temperature": 0.0, "tau": 1.0, "categories": {}}]
            + methods}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_seeds_pool_into_mean_and_spread_across_reports(tmp_path, capsys):
    a = write(tmp_path, "a.json", report([method("runs/exp/e3-s0/final", 1.4, 1.6),
                                          method("runs/exp/pe-s0/final", 1.3, 1.5)]))
    b = write(tmp_path, "b.json", report([method("runs/exp/e3-s1/final", 1.6, 1.6)]))
    assert suite_table.main([a, b]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| heads (seeds) | qa | math | all |"
    e3 = next(line for line in lines if line.startswith("| e3 "))
    assert e3 == "| e3 (2) | 1.500 ± 0.141 | 1.600 ± 0.000 | 1.550 ± 0.071 |"
    assert "| pe (1) | 1.300 | 1.500 | 1.400 |" in lines
    assert not any("hf-generate" in line for line in lines)  # baselines have no heads


def test_group_rule_and_accepted_key(tmp_path, capsys):
    a = write(tmp_path, "a.json", report([method("x/e3-s0", 1.4, 1.6, accepted=(0.4, 0.2))]))
    assert suite_table.main([a, "--group", "e3=EAGLE-3", "--key", "accepted"]) == 0
    assert "| EAGLE-3 (1) | 0.600 | 0.600 | 0.600 |" in capsys.readouterr().out


def test_reports_of_other_questions_are_not_pooled(tmp_path, capsys):
    a = write(tmp_path, "a.json", report([method("x/e3-s0", 1.4, 1.6)]))
    b = write(tmp_path, "b.json", report([method("x/e3-s1", 1.4, 1.6)], per_category=4))
    with pytest.raises(SystemExit):
        suite_table.main([a, b])
    assert "cannot be pooled" in capsys.readouterr().err


def comparison(heads, category, vllm, headway):
    """One category of an --engine vllm report: (accepted, drafts) per engine."""
    side = lambda acc, drafts: {"accepted": acc, "drafts": drafts, "tau": 1 + acc / drafts}  # noqa: E731
    return {"category": category, "heads": heads, "vllm": side(*vllm), "headway": side(*headway)}


def vllm_report(comparisons):
    data = report([])
    data["engine"] = "vllm"
    del data["methods"]
    data["comparisons"] = comparisons
    return data


def test_vllm_reports_pool_either_engines_counters(tmp_path, capsys):
    a = write(tmp_path, "a.json", vllm_report([comparison("x/e3-s0", "qa", (50, 100), (50, 100)),
                                               comparison("x/e3-s0", "math", (30, 300), (31, 299))]))
    b = write(tmp_path, "b.json", vllm_report([comparison("x/e3-s1", "qa", (70, 100), (70, 100)),
                                               comparison("x/e3-s1", "math", (30, 300), (30, 300))]))
    assert suite_table.main([a, b]) == 0
    # all: 1 + summed accepted / summed drafts per heads (s0 80/400, s1 100/400), then pooled over seeds
    assert "| e3 (2) | 1.600 ± 0.141 | 1.100 ± 0.000 | 1.225 ± 0.035 |" in capsys.readouterr().out
    assert suite_table.main([a, "--side", "headway"]) == 0
    assert f"| e3 (1) | 1.500 | {1 + 31 / 299:.3f} | {1 + 81 / 399:.3f} |" in capsys.readouterr().out


def test_reports_of_both_engines_or_other_keys_from_vllm_are_refused(tmp_path, capsys):
    v = write(tmp_path, "v.json", vllm_report([comparison("x/e3-s0", "qa", (50, 100), (50, 100))]))
    h = write(tmp_path, "h.json", report([method("x/e3-s1", 1.4, 1.6)]))
    with pytest.raises(SystemExit):
        suite_table.main([v, h])
    assert "both engines" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite_table.main([v, "--key", "accepted"])
    assert "tau only" in capsys.readouterr().err


def test_a_report_of_another_schema_is_refused(tmp_path, capsys):
    data = report([])
    data["schema"] = "headway.bench/1"
    with pytest.raises(SystemExit):
        suite_table.main([write(tmp_path, "v.json", data)])
    assert "not a headway eval report" in capsys.readouterr().err
