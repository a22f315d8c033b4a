"""benchmarks/adapt/smollm2_lora.py, piece by piece on a tiny chat target (the SmolLM2 run itself is
the lead's): the fine-tune's JSON-style examples, the LoRA fine-tune merged into a loadable target,
the held-out prompts as the gate formats them, and the report's goals."""

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from headway.data.distill import DistillConfig, distill
from headway.target import load_target
from headway.testing import tiny_target

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "adapt" / "smollm2_lora.py"
CHAT = ("{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")

pytestmark = pytest.mark.usefixtures("one_thread")


def _module():
    spec = importlib.util.spec_from_file_location("adapt_smollm2_lora", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _module()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model, tok = tiny_target("llama")
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    src = root / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(6)))
    data = distill(DistillConfig(source=str(src), target=str(root / "target"), output=str(root / "d"),
                                 max_new_tokens=8, batch_size=6))
    return root / "target", data, tok


def test_the_examples_are_the_answers_rewritten_as_json(setup):
    from headway.data.distill import load_distilled

    target, data, tok = setup
    examples = bench.json_examples(data, tok, 4)
    rows = load_distilled(data).to_list()[:4]
    assert len(examples) == 4
    for ex, row in zip(examples, rows):
        start = row["loss_mask"].index(1)
        assert ex["prompt"] == row["input_ids"][:start]
        styled = json.loads(tok.decode(ex["answer"][:-1]))
        original = row["input_ids"][start:] if row["finish_reason"] == "length" else row["input_ids"][start:-1]
        assert styled == {"answer": tok.decode(original).strip()}


def test_the_lora_fine_tune_is_merged_into_a_loadable_target(setup, tmp_path):
    target, data, tok = setup
    examples = bench.json_examples(data, tok, 4)
    result = bench.lora_finetune(target, examples, tmp_path / "fine", epochs=1, batch_size=2, lr=1e-2)
    assert result["steps"] == 2 and result["tokens"] > 0 and result["examples"] == 4
    fine, fine_tok = load_target(str(tmp_path / "fine"), device="cpu")
    base, _ = load_target(str(target), device="cpu")
    assert fine_tok.chat_template == CHAT and not (tmp_path / "fine.tmp").exists()
    changed = [n for n, p in fine.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
    assert any("q_proj" in n for n in changed) and not any("embed" in n for n in changed)
    assert 0.0 <= bench.style_share(tmp_path / "fine", [examples[0]["prompt"]], max_new_tokens=4) <= 1.0


def test_the_held_out_prompts_are_those_the_gate_measured(setup, tmp_path):
    from headway.adapt.measure import measure_ids
    from headway.data.chat import load_chat_template

    target, _, tok = setup
    rows = [{"id": "a", "prompt": "One?"}, {"id": "b", "messages": [{"role": "user", "content": "Two?"},
                                                                     {"role": "assistant", "content": "2"},
                                                                     {"role": "user", "content": "Three?"}]}]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ids = bench.heldout_prompts(tmp_path, tok, 8, 512)
    template = load_chat_template(tok, None)
    assert ids == [measure_ids(r, i, tok, template, "auto", "t") for i, r in enumerate(rows)]
    assert tok.decode(ids[1]).endswith("<|bos|>user\nThree?<|eos|>\n<|bos|>assistant\n")
    assert "<|bos|>assistant\n2<|eos|>" in tok.decode(ids[1])  # the logged answer stays in the context


def test_the_report_checks_the_issues_goals():
    met = bench.report({"base": 1.2, "adapted": 1.5, "scratch": 1.6}, {"adapted": 100.0, "scratch": 500.0})
    assert met["ratios"] == {"adapted_over_scratch_tau": 0.9375, "adapted_over_scratch_compute": 0.2,
                             "adapted_over_base_tau": 1.25}
    assert all(met["goals"].values())
    missed = bench.report({"base": 1.4, "adapted": 1.5, "scratch": 1.8}, {"adapted": 200.0, "scratch": 500.0})
    assert not any(missed["goals"].values())
    assert "goal beats_base_by_20pct: missed" in bench.table(missed)
    counted = bench.report({"base": 1.2, "adapted": 1.5, "scratch": 1.6}, {"adapted": 100.0, "scratch": 500.0},
                           {"distill_tokens": {"adapted": 30_000, "scratch": 120_000},
                            "train_tokens": {"adapted": 10_000, "scratch": 50_000}})
    assert counted["ratios"]["adapted_over_scratch_distill_tokens"] == 0.25
    assert counted["ratios"]["adapted_over_scratch_train_tokens"] == 0.2
    assert counted["goals"]["within_25pct_of_scratch_work"]
    over = bench.report({"base": 1.2, "adapted": 1.5, "scratch": 1.6}, {"adapted": 100.0, "scratch": 500.0},
                        {"distill_tokens": {"adapted": 30_000, "scratch": 120_000},
                         "train_tokens": {"adapted": 26_000, "scratch": 100_000}})
    assert not over["goals"]["within_25pct_of_scratch_work"]  # one part over the bar is enough
    assert "train_tokens" in bench.table(over)
