"""Every recipe under configs/ runs end to end at toy scale, so a typo or a stale key, value or path in
a recipe fails CI, not a user's 8-GPU job.

Each model's recipes run in the order their headers give, through the CLI, in a scratch folder with
``configs/`` linked in (so the YAML's ``runs/...`` and ``configs/...`` paths chain as they do for a
user). The target is a tiny random model of the recipe's architecture class with the real model's
layer count (so ``aux_layers`` and ``init_layer`` stay as written). Only scale changes (prompt
counts, answer lengths, steps, draft-vocabulary sizes) and what CI cannot reach: a Hub dataset or a
download is a local file, and vLLM is the fake engine of ``test_data_distill_vllm``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.cli import main
from headway.config import read_config_file
from headway.testing import tiny_target
from test_data_distill_vllm import fake_python

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# A ChatML-like template over the tiny tokenizer's specials: the user turn and the answer both end
# at <|eos|> (the target's EOS), as SmolLM2's, Llama-3.1's and Qwen3's templates end at theirs.
CHAT = ("{% for m in messages %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")

# model folder -> the tiny stand-in: architecture, the real layer count, tied embeddings, chat template
# (Vicuna's tokenizer has none: its recipe brings configs/vicuna-7b/vicuna.jinja)
MODELS: dict[str, dict[str, Any]] = {
    "demo": dict(arch="llama", num_hidden_layers=8, chat=False),
    "smollm2": dict(arch="llama", num_hidden_layers=30, tie_word_embeddings=True, chat=True),
    "llama3.1-8b": dict(arch="llama", num_hidden_layers=32, chat=True),
    "qwen3-8b": dict(arch="qwen3", num_hidden_layers=36, layer_types=["full_attention"] * 36, chat=True),
    "vicuna-7b": dict(arch="llama", num_hidden_layers=32, chat=False),
}

# What a user runs, in order: (command, recipe or arguments). Merges are the recipes' header lines.
F = "runs/smollm2-features"
SMOLLM2 = [
    ("distill", "smollm2/distill.yaml"), ("features", "smollm2/features.yaml"),
    ("distill", "smollm2/distill-more.yaml"), ("features", "smollm2/features-more.yaml"),
    ("distill", "smollm2/distill-extra.yaml"), ("features", "smollm2/features-extra.yaml"),
    ("merge", [F, f"{F}-more", "--output", f"{F}-3k"]),
    ("merge", [F, f"{F}-more", f"{F}-extra", "--output", f"{F}-6k"]),
    ("distill", "smollm2/distill-heldout.yaml"), ("features", "smollm2/features-heldout.yaml"),
    ("train", "smollm2/eagle3.yaml"), ("train", "smollm2/eagle3-3k.yaml"), ("train", "smollm2/eagle3-3k-e3.yaml"),
    ("train", "smollm2/eagle1.yaml"), ("train", "smollm2/medusa.yaml"), ("train", "smollm2/dflash.yaml"),
    ("train", "smollm2/eagle3-1k5.yaml"), ("adapt", "smollm2/adapt.yaml"), ("train", "smollm2/dflash-1k5.yaml"),
    ("train", "smollm2/peagle-1k5.yaml"), ("train", "smollm2/dspark-1k5.yaml"),
    ("train", "smollm2/eagle3-6k.yaml"), ("train", "smollm2/dflash-6k.yaml"),
    ("prompts", "smollm2/prompts.yaml"), ("distill", "smollm2/distill-self.yaml"),
    ("features", "smollm2/features-self.yaml"), ("merge", [f"{F}-6k", f"{F}-self", "--output", f"{F}-10k"]),
    ("train", "smollm2/eagle3-10k.yaml"),
    ("prompts", ["--config", "configs/smollm2/prompts-eval.yaml"]), ("prompts", "smollm2/prompts-more.yaml"),
    ("distill", "smollm2/distill-self-more.yaml"), ("features", "smollm2/features-self-more.yaml"),
    ("merge", [f"{F}-10k", f"{F}-self-more", "--output", f"{F}-12k"]), ("train", "smollm2/eagle3-12k.yaml"),
    # examples/smollm2_gpu.sh passes its own data folders
    ("train", ["--config", "configs/smollm2/eagle3-gpu.yaml", "--data", "runs/smollm2-distill",
               "--eval_data", "runs/smollm2-heldout"]),
]
STEPS: dict[str, list[tuple]] = {  # (command, recipe or argv[, extra overrides])
    "demo": [("distill", "demo/distill.yaml"), ("train", "demo/medusa.yaml"), ("train", "demo/eagle1.yaml"),
             ("train", "demo/eagle3.yaml"), ("adapt", "demo/adapt.yaml"), ("train", "demo/dflash.yaml"),
             ("train", "demo/peagle.yaml"), ("train", "demo/dspark.yaml")],
    "smollm2": SMOLLM2,
    "llama3.1-8b": [("distill", "llama3.1-8b/distill.yaml"), ("train", "llama3.1-8b/eagle3.yaml"),
                    ("train", "llama3.1-8b/medusa2.yaml")],
    # the fake vLLM engine's start (~25 s: a second Python importing transformers) is paid once, for the
    # walk-through's recipe above; these two run the same distill settings through the hf engine
    "qwen3-8b": [("distill", "qwen3-8b/distill.yaml", ["engine=hf"]), ("train", "qwen3-8b/eagle3.yaml")],
    "vicuna-7b": [("distill", "vicuna-7b/distill.yaml", ["engine=hf"]), ("train", "vicuna-7b/medusa1.yaml")],
}
TOY_DRAFT_VOCAB = 256  # the tiny tokenizer has 384 tokens; the recipes' 8,192 and 32,000 do not fit


def toy_target(folder: Path, model: str) -> Path:
    spec = dict(MODELS[model])
    arch, chat = spec.pop("arch"), spec.pop("chat")
    model_, tok = tiny_target(arch, **spec)
    with torch.no_grad():
        # EOS (id 1) likely enough under sampling that `headway prompts` sees user turns end, as a chat
        # model's do, and rare enough that greedy answers run their length (4 x row 10: both, for this seed)
        head = model_.get_output_embeddings().weight
        head[1] = 4.0 * head[10]
    if chat:
        tok = copy.deepcopy(tok)  # tiny_tokenizer is cached: the template must not leak into other tests
        tok.chat_template = CHAT
    model_.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def toy_overrides(command: str, recipe: dict[str, Any], target: Path, vllm: Path) -> list[str]:
    """Scale only: the keys a recipe keeps are its own."""
    if command == "distill":
        out = [f"target={target}", "limit=6", "max_new_tokens=8", "batch_size=6"]
        if "/" in recipe["source"] and not Path(recipe["source"]).suffix and not recipe["source"].startswith("runs/"):
            out.append("source=toy-hub-dataset.jsonl")  # a Hub dataset: CI is offline
        elif recipe["source"].endswith(".json"):
            out.append("source=toy-download.json")  # a file the user downloads
        if recipe.get("engine") == "vllm":
            out += [f"vllm_python={vllm}", "dtype=float32"]  # the fake engine runs float32 only
        return out
    if command == "prompts":
        return [f"target={target}", "num=2", "batch_size=16", "max_new_tokens=16", "min_chars=4"]
    if command == "adapt":  # the recipe's target is a fine-tune the benchmark script makes
        return [f"target={target}", "num_prompts=6", "distill.max_new_tokens=8", "distill.batch_size=6",
                "train.max_steps=1", "train.batch_size=2", "gate.max_new_tokens=8"]
    if command == "train":
        out = [f"target={target}", "max_steps=1", "batch_size=2", "eval_max_batches=1", "log_every=1"]
        for section in ("eagle", "medusa", "dflash", "peagle"):
            if (recipe.get(section) or {}).get("draft_vocab_size"):
                out.append(f"{section}.draft_vocab_size={TOY_DRAFT_VOCAB}")
        return out
    return []


def write_inputs(cwd: Path) -> None:
    """The files a user brings: a Hub dataset's rows and a downloaded ShareGPT file."""
    chats = [{"messages": [{"role": "user", "content": f"Write a function number {i}."},
                           {"role": "assistant", "content": "def f(): pass"},
                           {"role": "user", "content": "Now explain it."}]} for i in range(8)]
    (cwd / "toy-hub-dataset.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    share = [{"conversations": [{"from": "human", "value": f"What is {i} + {i}?"},
                                {"from": "gpt", "value": str(2 * i)}]} for i in range(8)]
    (cwd / "toy-download.json").write_text(json.dumps(share))


@pytest.mark.parametrize("model", list(STEPS))
def test_recipes_run_end_to_end_at_toy_scale(model, tmp_path, monkeypatch, one_thread):
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "configs").symlink_to(CONFIGS)
    write_inputs(cwd)
    target = toy_target(tmp_path / "target", model)
    vllm = fake_python(tmp_path)
    monkeypatch.chdir(cwd)
    for command, what, *extra in STEPS[model]:
        if isinstance(what, str):
            recipe = read_config_file(CONFIGS / what)
            args = ["--config", f"configs/{what}"] + toy_overrides(command, recipe, target, vllm)
        else:
            recipe = read_config_file(cwd / what[1]) if what[0] == "--config" else {}
            args = list(what) + toy_overrides(command, recipe, target, vllm)
        args += extra[0] if extra else []
        assert main([command, *args]) == 0, f"headway {command} {' '.join(args)}"
    trained = [read_config_file(CONFIGS / w) for c, w, *_ in STEPS[model] if c == "train" and isinstance(w, str)]
    for recipe in trained:
        assert (cwd / recipe["output_dir"] / "final" / "config.json").is_file(), recipe["output_dir"]


def test_every_recipe_is_run():
    """A new recipe must join a run above (configs/accelerate holds accelerate's own configs)."""
    run = {w for steps in STEPS.values() for _, w, *_ in steps if isinstance(w, str)}
    run |= {w[1].removeprefix("configs/") for steps in STEPS.values() for _, w, *_ in steps
            if not isinstance(w, str) and w[0] == "--config"}
    shipped = {p.relative_to(CONFIGS).as_posix() for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "accelerate"}
    assert shipped - {"demo/target.yaml"} == run  # the demo target's build is tests/test_demo_target.py's
