"""``headway eval`` on the headway engine: two-turn questions asked after the target's own answer,
bench's protocol per category (every T=0 row exact against HF greedy), the report, the plot, and the
table stored with the heads (their weights untouched)."""

import copy
import hashlib
import json

import pytest
import torch

from headway.bench.eval_configs import EvalConfig
from headway.bench.eval_report import card_entry, render_eval_table
from headway.bench.evaluate import SCHEMA, CATEGORY_KEYS, eval_cli, evaluate
from headway.bench.suite_prompts import question_plan, suite_prompts
from headway.bench.suites import SuiteError, SuiteItem
from headway.heads import Eagle3Drafter
from headway.heads.metadata import read_metadata
from headway.target import load_target
from headway.testing import save_tiny_target, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
ROWS = [{"question_id": 81, "category": "writing", "turns": ["Write a loop", "Now as a function"]},
        {"question_id": 82, "category": "coding", "turns": ["def add(a, b):", "And a test for it"]},
        {"question_id": 161, "category": "translation", "turns": ["Translate: hallo welt"]},
        {"question_id": 162, "category": "translation", "turns": ["Translate: guten tag"]},
        {"question_id": 241, "category": "qa", "turns": ["who wrote hamlet?"]}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    save_tiny_target(root / "target", "llama", seed=0)
    _, tok = tiny_target("llama", seed=0)
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root / "target")
    save_tiny_target(root / "raw-target", "llama", seed=0)  # the same model without a chat template
    model, _ = tiny_target("llama", seed=0)
    torch.manual_seed(0)
    Eagle3Drafter.for_target(model, draft_vocab_size=200).save_pretrained(root / "eagle3")
    (root / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


def config(root, **kw):
    base = dict(suite="spec-bench", target=str(root / "target"), heads=[str(root / "eagle3")],
                suite_file=str(root / "q.jsonl"), max_new_tokens=10, repeats=1, warmup=1, progress=False)
    return EvalConfig(**{**base, **kw})


# ---- two turns


def test_the_second_turn_is_asked_after_the_target_s_own_first_answer(folders):
    target, tok = load_target(str(folders / "target"), dtype="float32", device="cpu")
    item = SuiteItem("81", "mt_bench", ("Write a loop", "Now as a function"), "writing")
    greedy = lambda ids: target.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,  # noqa: E731
                                         pad_token_id=0)[0, len(ids):].tolist()
    calls = []
    built = suite_prompts([item], tok, tok.chat_template, "auto", "t", lambda ids: calls.append(ids) or greedy(ids),
                          [tok.eos_token_id], room=512)
    prompts, answers, fmt = built.prompts, built.answers, built.format
    assert [p.turn for p in prompts] == [1, 2] and fmt == "chat (template of the target)"
    first, second = prompts[0].ids, prompts[1].ids
    answer = answers[0]
    assert calls == [first] and answer == greedy(first)  # answered once, by the target itself
    assert second[:len(first)] == first and second[len(first):len(first) + len(answer)] == answer
    # then the template's text up to the second answer, the second question in it
    tail = tok.decode(second[len(first) + len(answer):])
    assert "Now as a function" in tail and tail.rstrip().endswith("<|assistant|>")
    assert "Write a loop" in tok.decode(first) and "Now as a function" not in tok.decode(first)
    assert len(question_plan(item, tok, tok.chat_template, "auto", "t").pieces) == 2


def test_a_two_turn_question_needs_a_chat_template(folders):
    _, tok = load_target(str(folders / "raw-target"), dtype="float32", device="cpu")
    item = SuiteItem("81", "mt_bench", ("a", "b"), "writing")
    with pytest.raises(SuiteError, match=r"question 81 \(mt_bench\) has 2 turns.*pass chat_template=FILE.jinja"):
        suite_prompts([item], tok, None, "auto", "raw-target", lambda ids: [], [], room=512)
    one = SuiteItem("1", "qa", ("who?",))
    built = suite_prompts([one], tok, None, "auto", "raw-target", lambda ids: [], [], room=512)
    assert built.format == "raw" and built.prompts[0].ids == tok("who?")["input_ids"] and built.too_long == []


def test_turns_that_fill_the_context_are_left_out_with_the_turns_after_them(folders):
    _, tok = load_target(str(folders / "target"), dtype="float32", device="cpu")
    short = SuiteItem("1", "qa", ("who?",))
    long_ = SuiteItem("2", "qa", ("word " * 300,))
    two = SuiteItem("3", "mt_bench", ("a question", "a follow-up"), "writing")
    answers = lambda ids: [5] * 40  # noqa: E731  (an answer that pushes the second turn past the room)
    first = len(suite_prompts([two], tok, tok.chat_template, "auto", "t", answers, [], room=10_000).prompts[0].ids)
    built = suite_prompts([short, long_, two], tok, tok.chat_template, "auto", "t", answers, [], room=first + 20)
    assert [p.name for p in built.prompts] == ["1", "3#turn1"]
    assert built.too_long == ["2", "3#turn2"]


# ---- the protocol, per category


@pytest.fixture(scope="module")
def report(folders):
    return evaluate(config(folders, temperature=[0.0, 1.0]))


def test_report_per_category(report, folders):
    assert report["schema"] == SCHEMA and report["engine"] == "headway"
    json.dumps(report)
    s = report["suite"]
    assert s["categories"] == {"mt_bench": {"questions": 2, "prompts": 4}, "translation": {"questions": 2, "prompts": 2},
                               "qa": {"questions": 1, "prompts": 1}}
    assert s["canonical"] is False and s["warnings"] and s["license"] == "Apache-2.0"
    names = [(m["name"], m["temperature"]) for m in report["methods"]]
    assert [n for n, t in names if t == 0] == ["hf-generate", "hf-weight-major", "eagle3[dynamic-4-5-16]"]
    for m in report["methods"]:
        assert list(m["categories"]) == ["mt_bench", "translation", "qa"]
        for c, e in m["categories"].items():
            assert set(e) == set(CATEGORY_KEYS) and e["prompts"] == s["categories"][c]["prompts"]
        # the categories partition the run: their tokens and forwards add up to the whole
        assert sum(e["new_tokens"] for e in m["categories"].values()) == m["new_tokens"]
        assert sum(e["target_forwards"] for e in m["categories"].values()) == m["target_forwards"]
        assert m["speedup_same_kernel"] is not None
        if m["temperature"] == 0:
            assert m["exact_match"] == 1.0 and all(e["exact_match"] == 1.0 for e in m["categories"].values())
        else:
            assert m["exact_match"] is None
    kernel = next(m for m in report["methods"] if m["kind"] == "hf_weight_major" and m["temperature"] == 0)
    assert kernel["speedup_same_kernel"] == 1.0 and all(e["speedup_same_kernel"] == 1.0
                                                         for e in kernel["categories"].values())
    heads = next(m for m in report["methods"] if m["kind"] == "eagle3" and m["temperature"] == 0)
    assert heads["draft_steps"] > 0 and len(heads["accepted_per_depth"]) == 5
    assert all(e["tau"] >= 1.0 for e in heads["categories"].values())


def test_the_table_names_every_category_and_method(report):
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(render_eval_table(report))
    text = console.export_text()
    for word in ("mt_bench", "translation", "qa", "all", "hf-weight-major", "eagle3[dynamic-4-5-16]", "× kernel",
                 "NOT the canonical file"):
        assert word in text, word


def test_eval_cli_writes_json_plot_and_the_card_without_touching_the_weights(folders, tmp_path):
    pytest.importorskip("matplotlib")
    heads = tmp_path / "eagle3"
    import shutil

    shutil.copytree(folders / "eagle3", heads)
    weights = hashlib.sha256((heads / "model.safetensors").read_bytes()).hexdigest()
    cfg = config(folders, heads=[str(heads)], json=str(tmp_path / "r.json"), plot=str(tmp_path / "r.png"),
                 categories=["translation", "qa"])
    assert eval_cli(cfg) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report["suite"]["categories"]) == ["translation", "qa"]
    assert (tmp_path / "r.png").stat().st_size > 1000
    assert hashlib.sha256((heads / "model.safetensors").read_bytes()).hexdigest() == weights
    stored = read_metadata(heads)["suites"]["spec-bench"]
    assert stored == json.loads(json.dumps(card_entry(report, str(heads))))
    assert [m["name"] for m in stored["methods"]] == ["eagle3[dynamic-4-5-16]"]
    card = (heads / "README.md").read_text()
    assert "## Standard suites" in card and "### spec-bench" in card
    assert "| translation | 2 |" in card and "| qa | 1 |" in card and "| **all** | 3 |" in card
    # a second suite is kept beside the first
    assert eval_cli(config(folders, heads=[str(heads)], categories=["qa"], suite="spec-bench", card=True,
                           per_category=1)) == 0
    assert set(read_metadata(heads)["suites"]) == {"spec-bench"}  # the same suite: the latest run replaces it


def test_the_per_category_sample_is_what_runs(folders):
    rep = evaluate(config(folders, per_category=1, baselines=["none"], seed=3))
    assert {c: v["questions"] for c, v in rep["suite"]["categories"].items()} == {"mt_bench": 1, "translation": 1,
                                                                                  "qa": 1}
    assert [m["name"] for m in rep["methods"]] == ["hf-generate", "eagle3[dynamic-4-5-16]"]
    assert all(m["speedup_same_kernel"] is None for m in rep["methods"])  # no same-kernel baseline asked for


def test_without_matplotlib_the_plot_is_one_line_and_the_results_are_kept(folders, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    cfg = config(folders, categories=["qa"], baselines=["none"], card=False, json=str(tmp_path / "r.json"),
                 plot=str(tmp_path / "r.png"))
    assert eval_cli(cfg) == 0
    assert json.loads((tmp_path / "r.json").read_text())["schema"] == SCHEMA and not (tmp_path / "r.png").exists()
    lines = [x for x in capsys.readouterr().out.splitlines() if "installed" in x]
    assert lines == ["plot skipped: matplotlib is not installed (pip install 'headway[plot]', or pip install "
                     "matplotlib)"]
