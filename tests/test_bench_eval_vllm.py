"""``headway eval --engine vllm``: the same prompts in vLLM and in headway's decoder, per category.

CI has no vLLM. The protocol pieces are tested on their own (the requests, the per-category
counters read as differences of vLLM's cumulative ones, the verdict); the whole command runs
against a stand-in vLLM (the real worker process and file protocol; its "engine" imports the
exported drafter back into headway and decodes a chain of ``num_speculative_tokens``, counting as
vLLM counts), including a control whose counts are off in one category, which must fail the
command and name that category. ``test_real_vllm_*`` runs the real engine where
$HEADWAY_VLLM_PYTHON or /work/vllm-venv has one.
"""

import copy
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from headway.bench import eval_vllm as EV
from headway.bench.eval_configs import EvalConfig
from headway.bench.evaluate import eval_cli, evaluate
from headway.bench.suite_prompts import SuitePrompt
from headway.bench.suites import SuiteItem
from headway.engines import spec_metrics as M
from headway.engines.spec_metrics import SpecCounters
from headway.engines.vllm_client import EngineError
from headway.heads import Eagle3Drafter, MedusaHeads
from headway.testing import save_tiny_target, tiny_target
from vllm_fakes import write_vllm_package

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROWS = [{"question_id": 81, "category": "coding", "turns": ["def add(a, b):", "Now a test for it"]},
        {"question_id": 161, "category": "translation", "turns": ["Translate: hallo welt"]},
        {"question_id": 162, "category": "translation", "turns": ["Translate: guten tag"]},
        {"question_id": 241, "category": "qa", "turns": ["who wrote hamlet?"]}]
# vLLM's CPU attention needs head_dim >= 32, and its EAGLE-3 reads layers before the last one
WIDE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=4)


def prompt(category, ids, item="1"):
    return SuitePrompt(SuiteItem(item, category, ("q",)), 1, ids)


# ---- the protocol pieces


def test_chain_length_and_speculative_config(tmp_path):
    assert EV.chain_length(None, "eagle3", None) == 3 and EV.chain_length(5, "dflash", 8) == 5
    assert EV.chain_length(None, "dflash", 8) == 7  # vLLM drafts a block of num_speculative_tokens + 1
    assert EV.speculative_config("eagle1", tmp_path, 4) == {"method": "eagle", "model": str(tmp_path),
                                                            "num_speculative_tokens": 4}
    assert {EV.speculative_config(k, tmp_path, 2)["method"] for k in ("medusa", "eagle3", "dflash")} == \
        {"medusa", "eagle3", "dflash"}
    assert EV.chain_length(None, "peagle", None, 5) == 5 and EV.chain_length(2, "peagle", None, 5) == 2  # K at most
    assert EV.speculative_config("peagle", tmp_path, 4) == {"method": "eagle3", "model": str(tmp_path),
                                                            "num_speculative_tokens": 4, "parallel_drafting": True}


def test_a_category_s_requests_are_greedy_ask_for_the_counters_and_group_by_budget():
    prompts = [prompt("qa", [1, 2]), prompt("qa", [3]), prompt("rag", [4]), prompt("qa", [5, 6, 7])]
    reqs = EV.category_request(prompts, [0, 1, 3], [8, 8, 8, 5], [0, 2])
    assert [r["index"] for r in reqs] == [[0, 1], [3]]
    assert reqs[0]["prompts"] == [[1, 2], [3]] and reqs[1]["prompts"] == [[5, 6, 7]]
    assert [r["max_tokens"] for r in reqs] == [8, 5]
    for r in reqs:
        assert r["temperature"] == 0.0 and r["metrics"] is True and r["stop_token_ids"] == [0, 2]
        assert r["seeds"] == [None] * len(r["prompts"])
    assert EV.context_needed(prompts, [8, 8, 8, 5], 3, 512) == 2 + 8 + 3 + 1  # prompt 0 and its 8 tokens
    assert EV.context_needed(prompts, [8, 8, 8, 5], 3, 12) == 12  # capped at the target's context


class CountingWorker:
    """An engine that answers each prompt with its own ids reversed and counts 2 drafts per prompt,
    position 1 accepted once per prompt: cumulative, as vLLM's counters are."""

    def __init__(self):
        self.drafts, self.accepted, self.requests = 0, 0, []

    def generate(self, req):
        self.requests.append(req)
        self.drafts += 2 * len(req["prompts"])
        self.accepted += len(req["prompts"])
        metrics = {M.DRAFTS: self.drafts, M.ACCEPTED: self.accepted, M.PER_POSITION: [self.accepted, 0]}
        return {"outputs": [{"token_ids": p[::-1]} for p in req["prompts"]], "metrics": metrics}


def test_per_category_counts_are_the_differences_of_cumulative_readings():
    prompts = [prompt("qa", [1, 2]), prompt("rag", [3, 4]), prompt("qa", [5]), prompt("rag", [6]), prompt("rag", [7])]
    groups = {"qa": [0, 2], "rag": [1, 3, 4]}
    outputs, counts, seconds = EV.vllm_side(CountingWorker(), prompts, groups, [4] * 5, [0])
    assert outputs == [[2, 1], [4, 3], [5], [6], [7]]
    assert counts["qa"] == SpecCounters(4, 0, 2, (2, 0)) and counts["rag"] == SpecCounters(6, 0, 3, (3, 0))
    assert set(seconds) == {"qa", "rag"}


def test_a_category_whose_outputs_differ_is_named():
    ok = SpecCounters.from_steps(4, [2, 1], 2)
    ref = [[1, 2], [3, 4]]
    row = EV.compare_category("qa", [0, 1], ok, ok, ref, ref, ref, ["q0", "q1"], 0.0)
    assert row["ok"] and row["problems"] == [] and row["prompts"] == 2
    row = EV.compare_category("qa", [0, 1], ok, ok, ref, [[1, 2], [3, 5]], ref, ["q0", "q1"], 0.0)
    assert not row["ok"] and row["problems"] == [
        "category 'qa': vLLM's output differs from the target's greedy output on 1 of 2 prompts (first: q1)"]


# ---- the whole command against a stand-in engine

FAKE_VLLM = '''
"""A stand-in for vLLM's speculative decoding: the drafter it is given (a headway export) imported
back into headway and decoded as a greedy chain of num_speculative_tokens; counters as vLLM keeps them."""
import os

import torch

__version__ = "0.0+fake"
MISCOUNT_AT = int(os.environ.get("FAKE_VLLM_MISCOUNT_AT_CALL", "0"))  # the control: one request miscounted


class SamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop_token_ids=None, max_tokens=16,
                 detokenize=True):
        assert temperature == 0.0 and seed is None
        self.max_tokens, self.stop_token_ids = max_tokens, list(stop_token_ids or [])


class _Completion:
    def __init__(self, token_ids):
        self.token_ids, self.finish_reason = token_ids, "length"


class _Output:
    def __init__(self, completion):
        self.outputs = [completion]


class LLM:
    def __init__(self, model, dtype, seed, max_model_len, enforce_eager, generation_config, speculative_config,
                 disable_log_stats):
        from headway.decode import Speculator
        from headway.heads.importers import import_heads

        assert dtype == "float32" and disable_log_stats is False
        torch.set_num_threads(1)
        self.k = speculative_config["num_speculative_tokens"]
        self.spec = Speculator.from_pretrained(model, import_heads(speculative_config["model"]),
                                               tree=f"chain-{self.k}", linear_kernel="stock")
        self.drafts, self.per_pos, self.calls = 0, [0] * self.k, 0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls += 1
        outs = []
        for x, p in zip(prompts, params):
            out = self.spec.generate(list(x["prompt_token_ids"]), max_new_tokens=p.max_tokens, temperature=0.0)
            self.drafts += out.stats.target_forwards
            for d, n in enumerate(out.stats.accepted_per_depth[:self.k]):
                self.per_pos[d] += n
            outs.append(_Output(_Completion(list(out.ids))))
        if self.calls == MISCOUNT_AT:
            self.per_pos[0] += 1
        return outs

    def get_metrics(self):
        from vllm.v1.metrics.reader import Counter, Vector

        return [Counter("vllm:spec_decode_num_drafts", {}, self.drafts),
                Counter("vllm:spec_decode_num_draft_tokens", {}, self.drafts * self.k),
                Counter("vllm:spec_decode_num_accepted_tokens", {}, sum(self.per_pos)),
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {}, list(self.per_pos))]
'''


def fake_python(root: Path, **env: str) -> Path:
    """This interpreter with the stand-in vllm package in its environment (and ``env``)."""
    write_vllm_package(root / "fake", FAKE_VLLM)
    sets = " ".join(f"{k}={v}" for k, v in env.items())
    script = root / ("python" + "-".join(env))
    script.write_text(f"#!/bin/sh\n{sets} PYTHONPATH={root / 'fake'} exec {sys.executable} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-vllm")
    save_tiny_target(root / "target", "llama", seed=0, **WIDE)
    model, tok = tiny_target("llama", seed=0, **WIDE)
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root / "target")
    torch.manual_seed(0)
    Eagle3Drafter.for_target(model, draft_vocab_size=200, aux_layers=[1, 2, 3]).save_pretrained(root / "eagle3")
    medusa = MedusaHeads.for_target(model, num_heads=3)
    with torch.no_grad():
        for p in medusa.blocks.parameters():
            p.normal_(0, 0.05)
    medusa.save_pretrained(root / "medusa")
    (root / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


def config(root, python, **kw):
    base = dict(suite="spec-bench", target=str(root / "target"), heads=[str(root / "eagle3"), str(root / "medusa")],
                suite_file=str(root / "q.jsonl"), max_new_tokens=12, engine="vllm", vllm_python=str(python),
                progress=False, card=False)
    return EvalConfig(**{**base, **kw})


def test_both_engines_per_category_through_the_worker(folders, tmp_path):
    report = evaluate(config(folders, fake_python(tmp_path)))
    assert report["engine"] == "vllm" and report["vllm"]["version"] == "0.0+fake"
    rows = report["comparisons"]
    assert [(r["heads_name"], r["category"]) for r in rows] == [
        (h, c) for h in ("eagle3[chain-3]", "medusa[chain-3]") for c in ("mt_bench", "translation", "qa")]
    assert [r["prompts"] for r in rows[:3]] == [2, 2, 1]  # the coding question's two turns are mt_bench's
    for r in rows:
        assert r["ok"], r["problems"]
        assert r["headway"] == r["vllm"] and r["headway"]["drafts"] > 0 and r["k"] == 3


def test_peagle_heads_run_as_vllm_runs_them_with_their_k(folders, tmp_path):
    """P-EAGLE through the worker: exported in vLLM's layout, served as EAGLE-3 with parallel drafting
    (the stand-in imports the export and decodes it with headway), a chain of the drafter's K by default."""
    from headway.heads import PEagleDrafter
    from headway.target import load_target

    model, _ = load_target(str(folders / "target"))
    torch.manual_seed(0)
    heads = PEagleDrafter.for_target(model, draft_vocab_size=200, aux_layers=[1, 2, 3], num_depths=4)
    path = heads.save_pretrained(tmp_path / "peagle")
    rows = evaluate(config(folders, fake_python(tmp_path), heads=[str(path)]))["comparisons"]
    assert [r["heads_name"] for r in rows] == ["peagle[chain-4]"] * 3
    assert all(r["ok"] and r["k"] == 4 and r["kind"] == "peagle" and r["headway"] == r["vllm"] for r in rows)


def test_a_category_the_engines_disagree_on_fails_the_command_and_is_named(folders, tmp_path, capsys):
    """The control: the stand-in miscounts its second request (the translation category's): the
    command exits 1 and names that category, and only that one."""
    python = fake_python(tmp_path, FAKE_VLLM_MISCOUNT_AT_CALL="2")
    rc = eval_cli(config(folders, python, heads=[str(folders / "eagle3")], json=str(tmp_path / "r.json")))
    err = capsys.readouterr().out
    assert rc == 1
    lines = [x for x in err.splitlines() if x.startswith("headway and vLLM disagree")]
    assert len(lines) == 1 and lines[0].startswith(
        "headway and vLLM disagree on eagle3[chain-3]: category 'translation': vLLM accepted")
    rows = json.loads((tmp_path / "r.json").read_text())["comparisons"]
    assert [r["ok"] for r in rows] == [True, False, True]
    # a tolerance that covers a one-count gap lets it through
    assert eval_cli(config(folders, python, heads=[str(folders / "eagle3")], tolerance=0.5)) == 0


def test_a_missing_engine_is_one_line_before_the_target_loads(folders, tmp_path):
    with pytest.raises(EngineError, match=r"vLLM python .*nope does not exist; create a vLLM environment with"):
        evaluate(config(folders, tmp_path / "nope"))


# ---- the real engine, where there is one

REAL = os.environ.get("HEADWAY_VLLM_PYTHON") or ("/work/vllm-venv/bin/python"
                                                  if Path("/work/vllm-venv/bin/python").exists() else None)


@pytest.mark.skipif(REAL is None, reason="no vLLM environment ($HEADWAY_VLLM_PYTHON or /work/vllm-venv)")
def test_real_vllm_counts_what_headway_counts(folders, tmp_path):
    report = evaluate(config(folders, REAL, heads=[str(folders / "eagle3")]))
    assert not report["vllm"]["version"].startswith("0.0")
    assert [r["category"] for r in report["comparisons"]] == ["mt_bench", "translation", "qa"]
    for r in report["comparisons"]:
        assert r["ok"], r["problems"]
        assert r["vllm"]["drafts"] == r["headway"]["drafts"] > 0
