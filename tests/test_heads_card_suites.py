"""The standard suites' tables in the heads' model card: rendered from ``metadata["suites"]`` (what
``headway eval`` stores with ``update_metadata``), rewritten in place only where the README is
headway's own card."""

from headway.heads import Eagle3Drafter
from headway.heads.card import model_card, refresh_card
from headway.heads.metadata import read_metadata, update_metadata
from headway.testing import tiny_target

HEADWAY_RUN = {
    "suite": "spec-bench", "engine": "headway", "created": "2026-12-06T10:00:00+00:00",
    "source": "/home/someone/data/question.jsonl", "canonical": True, "per_category": 10, "seed": 0, "questions": 60,
    "max_new_tokens": 128, "target": "/root/.cache/headway/targets/smollm2-0.1.2", "threads": 2,
    "methods": [{"name": "eagle3[measured-16]", "tree": "measured-16", "temperature": 0.0,
                 "all": {"prompts": 70, "tau": 2.01, "accepted_per_depth": [0.6, 0.3], "tokens_per_s": 40.0,
                         "speedup": 1.5, "speedup_same_kernel": 1.2, "exact_match": 1.0},
                 "categories": {"mt_bench": {"prompts": 20, "tau": 1.9, "accepted_per_depth": [0.55, 0.25],
                                             "tokens_per_s": 38.1, "speedup": 1.41, "speedup_same_kernel": 1.12,
                                             "exact_match": 1.0},
                                "rag": {"prompts": 10, "tau": 2.31, "accepted_per_depth": [0.7, 0.4],
                                        "tokens_per_s": 45.2, "speedup": 1.72, "speedup_same_kernel": None,
                                        "exact_match": 1.0}}}]}
VLLM_RUN = {"suite": "spec-bench", "engine": "vllm", "created": "2026-12-06", "source": "question.jsonl",
            "canonical": False, "per_category": 0, "seed": 0, "questions": 480, "max_new_tokens": 64, "threads": 2,
            "target": "t", "vllm_version": "0.32.0",
            "comparisons": [{"category": "qa", "prompts": 80, "k": 3, "ok": True, "tau_headway": 1.8123,
                             "tau_vllm": 1.8123, "rate_per_position_vllm": [0.5, 0.2, 0.1]},
                            {"category": "rag", "prompts": 80, "k": 3, "ok": False, "tau_headway": 2.0,
                             "tau_vllm": 1.9, "rate_per_position_vllm": [0.6, 0.2, 0.1]}]}


def cfg(suites):
    return {"kind": "eagle3", "headway_version": "0.1.0", "target": {"name_or_path": "/abs/target"},
            "metadata": {"suites": suites}}


def test_the_card_shows_each_suite_s_table_per_category():
    card = model_card(cfg({"spec-bench": HEADWAY_RUN, "spec-bench@vllm": VLLM_RUN}))
    assert "## Standard suites" in card and "### spec-bench\n" in card and "### spec-bench in vLLM" in card
    assert "60 questions, 10 per category (seed 0) from question.jsonl (the canonical file), 128 new tokens" in card
    assert "| mt_bench | 20 | 1.90 | 0.55 / 0.25 | 38.1 | 1.41× | 1.12× |" in card
    assert "| rag | 10 | 2.31 | 0.70 / 0.40 | 45.2 | 1.72× | - |" in card
    assert "| **all** | 70 | 2.01 | 0.60 / 0.30 | 40.0 | 1.50× | 1.20× |" in card
    assert "| qa | 80 | 3 | 1.812 | 1.812 | 0.50 / 0.20 / 0.10 | yes |" in card and "| rag | 80 | 3 | 2.000 | 1.900" in card
    assert "/home/someone" not in card and "/root/" not in card  # never a local path
    assert model_card(cfg({})).count("Standard suites") == 0


def test_refresh_card_rewrites_headway_s_card_and_leaves_a_user_s_own(tmp_path):
    model, _ = tiny_target("llama", seed=0)
    folder = Eagle3Drafter.for_target(model, draft_vocab_size=50).save_pretrained(tmp_path / "heads")
    weights = (folder / "model.safetensors").read_bytes()
    update_metadata(folder, {"suites": {"spec-bench": HEADWAY_RUN}})
    assert refresh_card(folder) == folder / "README.md"
    assert "| rag | 10 | 2.31 |" in (folder / "README.md").read_text()
    assert read_metadata(folder)["suites"]["spec-bench"] == HEADWAY_RUN
    (folder / "README.md").write_text("# My own notes\n")
    assert refresh_card(folder) is None and (folder / "README.md").read_text() == "# My own notes\n"
    assert (folder / "model.safetensors").read_bytes() == weights
