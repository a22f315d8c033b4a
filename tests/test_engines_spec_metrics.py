"""vLLM's spec-decode counters as headway reads them (``engines/spec_metrics.py``) and as the worker
reports them (``vllm_worker.spec_metrics``, against a stand-in for ``vllm.v1.metrics.reader``), and the
verdict that fails ``headway eval --engine vllm``: it names the category, and it can fail."""

import json
import sys

import pytest

from headway.engines import spec_metrics as M
from headway.engines.spec_metrics import SpecCounters, parity_problems
from vllm_fakes import write_vllm_package


def reading(drafts, per_pos, k=3):
    return {M.DRAFTS: drafts, M.DRAFT_TOKENS: drafts * k, M.ACCEPTED: sum(per_pos), M.PER_POSITION: list(per_pos)}


def test_a_reading_and_the_difference_of_two():
    first = SpecCounters.from_metrics(reading(10, [6, 3, 1]))
    assert first == SpecCounters(10, 30, 10, (6, 3, 1))
    later = SpecCounters.from_metrics(reading(25, [14, 8, 2]))
    assert later.minus(first) == SpecCounters(15, 45, 14, (8, 5, 1))
    assert later.minus(first).tau == pytest.approx(1 + 14 / 15)
    assert later.minus(first).rates() == pytest.approx([8 / 15, 5 / 15, 1 / 15])
    assert SpecCounters().minus(SpecCounters()).tau is None and SpecCounters().rates() == []
    assert SpecCounters.from_metrics({}) == SpecCounters()
    # a vector that grew a position since the first reading is padded, not cut
    assert SpecCounters(5, 20, 3, (2, 1, 0, 0)).minus(SpecCounters(1, 3, 1, (1,))).per_position == (1, 1, 0, 0)


def test_headway_s_steps_as_counters():
    c = SpecCounters.from_steps(12, [7, 4], k=3)  # a run that never accepted position 3
    assert c == SpecCounters(12, 36, 11, (7, 4, 0))
    assert SpecCounters.from_steps(12, [7, 4, 2, 1], k=3).per_position == (7, 4, 2)
    assert c.as_dict() == {"drafts": 12, "draft_tokens": 36, "accepted": 11, "accepted_per_position": [7, 4, 0],
                           "tau": pytest.approx(1 + 11 / 12), "rate_per_position": [0.5833, 0.3333, 0.0]}


def test_equal_counts_agree_and_any_difference_names_the_category():
    hw = SpecCounters.from_steps(20, [10, 5, 2], 3)
    assert parity_problems("qa", hw, SpecCounters(20, 60, 17, (10, 5, 2)), 0.0) == []
    off = parity_problems("qa", hw, SpecCounters(20, 60, 16, (10, 5, 1)), 0.0)
    assert len(off) == 1 and off[0].startswith("category 'qa': vLLM accepted [10, 5, 1] of 20 drafts, headway "
                                               "[10, 5, 2] of 20")
    assert parity_problems("rag", hw, SpecCounters(21, 63, 17, (10, 5, 2)), 0.0)  # one draft more: not equal


def test_a_tolerance_allows_a_rate_gap_and_no_more():
    hw = SpecCounters.from_steps(100, [50, 30, 10], 3)
    near = SpecCounters(100, 300, 90, (52, 29, 9))
    assert parity_problems("math", hw, near, 0.05) == []
    far = SpecCounters(100, 300, 80, (50, 20, 10))
    problems = parity_problems("math", hw, far, 0.05)
    assert len(problems) == 1 and "category 'math'" in problems[0] and "position 2 by 0.100" in problems[0]
    assert "position 1" not in problems[0]
    assert parity_problems("math", hw, near, 0.0)  # the same gap fails the default (equal counts)




def test_the_worker_reads_vllm_s_counters_summed_over_engines(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_vllm_package(tmp_path)))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    from headway.engines import vllm_worker

    class LLM:  # two engines (data parallel): the same names with other labels
        def get_metrics(self):
            return [Counter(M.DRAFTS, {"engine": "0"}, 4), Counter(M.DRAFTS, {"engine": "1"}, 6),
                    Counter(M.ACCEPTED, {"engine": "0"}, 5), Vector(M.PER_POSITION, {"engine": "0"}, [3, 2]),
                    Vector(M.PER_POSITION, {"engine": "1"}, [1, 0, 1]), Counter("vllm:num_requests", {}, 9),
                    Gauge("vllm:spec_decode_gauge_not_a_counter", {}, 0.5)]

    got = vllm_worker.spec_metrics(LLM())
    assert got == {M.DRAFTS: 10, M.ACCEPTED: 5, M.PER_POSITION: [4, 2, 1]}
    assert SpecCounters.from_metrics(got) == SpecCounters(10, 0, 5, (4, 2, 1))


RECORDING_VLLM = """
import json, os

__version__ = "0.0+fake"


class SamplingParams:
    def __init__(self, **kw):
        self.max_tokens = kw["max_tokens"]


class _Out:
    def __init__(self, ids):
        self.token_ids, self.finish_reason = ids, "length"


class _Req:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, **kwargs):
        with open(os.environ["FAKE_KWARGS"], "w") as f:
            json.dump(kwargs, f)

    def generate(self, prompts, params, use_tqdm=True):
        return [_Req(list(range(p.max_tokens))) for p in params]

    def get_metrics(self):
        from vllm.v1.metrics.reader import Counter, Vector

        return [Counter("vllm:spec_decode_num_drafts", {}, 7), Vector("vllm:spec_decode_num_accepted_tokens_per_pos",
                                                                      {}, [5, 2])]
"""


@pytest.mark.parametrize("spec", [None, {"method": "eagle3", "model": "/x", "num_speculative_tokens": 2}])
def test_the_worker_serves_a_drafter_with_stats_on_and_returns_the_counters(spec, tmp_path, monkeypatch):
    """vLLM counts nothing with disable_log_stats (its default): the engine turns stats on exactly when it
    serves a drafter, and a request asking for the counters gets them; without a drafter the engine is
    started as ``headway distill --engine vllm`` always started it."""
    import stat

    from headway.engines.vllm_client import VllmWorker

    write_vllm_package(tmp_path / "fake", RECORDING_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nFAKE_KWARGS={tmp_path / 'kw.json'} PYTHONPATH={tmp_path / 'fake'} "
                      f"exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    request = {"prompts": [[1, 2]], "seeds": [None], "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 3,
               "stop_token_ids": []}
    with VllmWorker(python, "model-dir", tmp_path / "work", speculative_config=spec) as worker:
        assert worker.wait_ready() == "0.0+fake"
        plain = worker.generate(request)
        counted = worker.generate({**request, "metrics": True})
    kwargs = json.loads((tmp_path / "kw.json").read_text())
    assert plain == {"outputs": [{"token_ids": [0, 1, 2], "finish_reason": "length"}]}
    assert counted["metrics"] == {M.DRAFTS: 7, M.PER_POSITION: [5, 2]}
    if spec is None:
        assert "speculative_config" not in kwargs and "disable_log_stats" not in kwargs
    else:
        assert kwargs["speculative_config"] == spec and kwargs["disable_log_stats"] is False
