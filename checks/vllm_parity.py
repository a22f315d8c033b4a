"""Interop check: heads exported by `headway export --format vllm` / `--format speculators`, run in a real engine.

    .venv/bin/python checks/vllm_parity.py            # ~11 min on 2 busy cores (+2 min the first time)
    .venv/bin/python checks/vllm_parity.py --heads runs/demo-medusa/final runs/demo-eagle3/final/heads
    .venv/bin/python checks/vllm_parity.py --formats speculators   # only the speculators exports (EAGLE-3)

The CPU build of vLLM lives in its own virtual environment (default ~/.cache/headway/vllm-venv,
created on first use: ~2 min, ~2.5 GB; it pins torch 2.13+cpu and transformers<5.20, so it never
shares the project's). For the target (the cached demo target, else the `tiny` preset with 32-wide
attention heads: vLLM's CPU attention needs head_dim >= 32) and each heads checkpoint, greedy fp32:

  (a) token ids: vLLM with the exported drafter == vLLM without speculation == headway's decoder;
  (b) acceptance per draft position: vLLM's `vllm:spec_decode_num_accepted_tokens_per_pos` against
      headway's chain decoder (`accepted_per_depth`) on the same prompts and draft length —
      equal counts, for *probe* drafters built here (their proposals are fixed tokens, so acceptance
      is decided by the target alone) and, by default, for trained heads too (every correct export
      so far matched exactly in fp32 on CPU); `--tolerance R` allows a per-position rate gap R for
      trained heads where float differences between engines can flip near-tied drafter argmaxes.

Probe drafters (one per kind): Medusa heads with one ResBlock whose bias pushes a constant
direction and an lm_head that maps it to token X_k for head k (the K tokens that most often follow
one token in the target's own greedy output); EAGLE-1 and EAGLE-3 drafters whose attention is
zero and whose MLP sums the squares of the normalised input (a constant, sum n_j^2 = H), so their
output always points the same way: through the target's lm_head (EAGLE-1) or their own lm_head
and d2t over a reduced draft vocabulary (EAGLE-3) it always reads X.

Trained heads are used when given with --heads, or found under runs/ for the same target; else
(--train-steps, default 150) the script distils 256 code snippets greedily with `headway distill`
and trains each kind briefly with `headway train` (DFlash with blocks of draft length + 1: the engine
drafts num_speculative_tokens + 1 slots, and a block's slots attend to each other). A negative
control exports the trained EAGLE-3 (and DFlash) heads with their aux layer ids one too low (what
SGLang's numbering would do in vLLM): the token ids stay equal (speculation is lossless), so only the
acceptance comparison can catch it — and must. The kind `eagle3-norms` is EAGLE-3 trained with
speculators' three norm options (`eagle.norm_before_fc`, `eagle.norm_before_residual`,
`eagle.norm_output`), which vLLM computes from the exported config; its negative control writes
`norm_before_residual` and `norm_output` false (what an exporter that dropped them would write).

P-EAGLE (`peagle`, trained with K = the draft length) runs as vLLM runs it, its EAGLE-3 drafter with
`parallel_drafting`; its negative control exports the mask token one lower (docs/peagle.md).

Formats (--formats): `vllm` (every kind, the target named in `speculative_config`) and `speculators`
(EAGLE-3, DFlash and P-EAGLE; vLLM 0.32.0 has no EAGLE-1 or Medusa speculators type). A speculators export is started
as `LLM(model=EXPORT)`: vLLM finds the verifier (the target) in its config by itself. Each format gets
the same checks and its own negative control.
Exit status 0 when every check passes, 1 otherwise; results in WORK/results.json.

This file is also the worker that runs inside the vLLM environment (`--worker JOB.json`): that
part imports only the standard library and vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_VENV = "~/.cache/headway/vllm-venv"
# EAGLE-3 trained with speculators' three norm options, which vLLM computes (llama_eagle3.py)
NORMS_KIND = "eagle3-norms"
NORM_OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")
DEFAULT_WORK = "~/.cache/headway/interop"
METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


# ================================ worker: runs in the vLLM venv ================================
def worker(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    from vllm import LLM, SamplingParams

    llm = LLM(model=job.get("model") or job["target"], dtype="float32", max_model_len=job["max_model_len"],
              enforce_eager=True, seed=0, speculative_config=job["spec"], disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    metrics = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            metrics[m.name] = list(m.values) if hasattr(m, "values") else m.value
    Path(job["result"]).write_text(json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                               "metrics": metrics}))


# ================================ driver: runs in the project venv =============================
def ensure_venv(venv: Path) -> Path:
    from headway.engines.vllm_client import VLLM_SPEC  # the one pin (headway distill --engine vllm uses it too)

    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"creating the vLLM environment {venv} ({VLLM_SPEC}; ~2 min, ~2.5 GB) ...", flush=True)
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", VLLM_SPEC], check=True)
    # the CUDA builds these pull in break `import vllm` on a CPU machine
    subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True, capture_output=True)
    return python


def find_target(arg: str | None) -> Path:
    """--target, else the cached demo target, else the tiny preset with head_dim 32 (built in ~1 min)."""
    from headway.demo.builder import TargetBuildConfig, build_demo_target, target_dir

    if arg:
        from headway.target import resolve_target_path

        return Path(resolve_target_path(arg))
    demo = target_dir(TargetBuildConfig(preset="demo"))  # this exact build: the cache also holds other demo-*
    if (demo / "config.json").is_file():                 # folders (e.g. bench's 2-layer assistant)
        return demo
    return build_demo_target(TargetBuildConfig(preset="tiny", num_heads=2, num_kv_heads=1), progress=False)


def find_trained_heads(target_dir: Path, given: list[str]) -> list[Path]:
    """--heads, else native checkpoints under runs/ whose recorded target is this one."""
    if given:
        return [Path(h) for h in given]
    found = []
    for cfg in sorted(Path("runs").glob("**/config.json")):
        try:
            c = json.loads(cfg.read_text())
        except (OSError, ValueError):
            continue
        t = (c.get("target") or {}).get("name_or_path") or ""
        if c.get("kind") and t and Path(t).expanduser().resolve() == target_dir.resolve() and "final" in cfg.parts:
            found.append(cfg.parent)
    return found


def code_snippets(held_out: bool) -> list[str]:
    """Code from the standard library starting at a `def` line: every 7th such line is held out
    for evaluation, the others can train heads."""
    from headway.testing import sample_texts

    out = []
    for text in sample_texts():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def ") and (i % 7 == 0) == held_out:
                out.append("\n".join(lines[i:i + 12]))
    return out


def code_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n held-out code prefixes of exactly `length` tokens."""
    prompts = []
    for text in code_snippets(held_out=True):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
        if len(ids) == length and len(prompts) < n:
            prompts.append(ids)
    return prompts


def source_prompts(tokenizer, source: str, n: int) -> list[list[int]]:
    """The first n prompts of a headway prompt source (`chat:dev`, a JSONL file, ...), tokenised as
    `headway distill` and `headway bench` condition the target's answer (its chat template where it has one)."""
    from headway.data.chat import load_chat_template
    from headway.data.plans import prompt_ids
    from headway.data.sources import read_samples

    template = load_chat_template(tokenizer, None)
    rows = [prompt_ids(s, tokenizer, template)[0] for s in read_samples(source, tokenizer=tokenizer, limit=n).samples]
    return [r for r in rows if r]


def train_heads(target_dir: Path, work: Path, kinds: list[str], steps: int, K: int, vocab: int) -> list[Path]:
    """Quick heads for this target: `headway distill` (greedy answers to 256 training snippets),
    then `headway train` for each kind. Resumable: finished parts are reused."""
    data, prompts = work / "train-data", work / "train-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t[:400]}) + "\n" for t in code_snippets(held_out=False)[:256]))
    hw = [sys.executable, "-m", "headway"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1"}
    subprocess.run(hw + ["distill", str(prompts), "--target", str(target_dir), "--output", str(data),
                         "--prompt_format", "raw", "--max_new_tokens", "64", "--temperature", "0",
                         "--batch_size", "16"], check=True, env=env)
    found = []
    for kind in kinds:
        out = work / f"train-{kind}"
        norms = [f"eagle.{k}=true" for k in NORM_OPTIONS] if kind == NORMS_KIND else []
        kind = "eagle3" if kind == NORMS_KIND else kind
        final = [c.parent for c in sorted((out / "final").glob("**/config.json"))] if (out / "final").exists() else []
        if not final:
            subprocess.run(hw + ["train", f"kind={kind}", f"target={target_dir}", f"data={data}", f"output_dir={out}",
                                 f"max_steps={steps}", "batch_size=8", "progress=false", "save_every=0",
                                 "eval_fraction=0.05", "optim.lr=0.003", "optim.warmup_steps=10",
                                 f"medusa.num_heads={K}", "eagle.ttt_steps=3"]
                           # EAGLE-1 exports drop a draft vocabulary (vLLM drafts over all rows): keep the
                           # full one here so headway and vLLM draft the same tokens
                           + ([f"eagle.draft_vocab_size={min(512, vocab)}"] if kind == "eagle3" else []) + norms
                           # DFlash: the engine drafts blocks of num_speculative_tokens + 1, and a block's
                           # slots attend to each other, so the drafter is trained with exactly that block
                           + ([f"dflash.block_size={K + 1}", f"dflash.draft_vocab_size={min(512, vocab)}",
                               "dflash.anchors=16", f"dflash.aux_layers={dflash_layers_of(target_dir)}"]
                              if kind == "dflash" else [])
                           # P-EAGLE: trained to draft exactly the K tokens the engine asks for per step
                           + ([f"peagle.num_depths={K}", f"peagle.draft_vocab_size={min(512, vocab)}"]
                              if kind == "peagle" else []),
                           check=True, env=env)
            final = [c.parent for c in sorted((out / "final").glob("**/config.json"))]
        found += final[:1]
    return found


def case_kind(heads) -> str:
    """The kind, or NORMS_KIND for EAGLE-3 drafters with any of speculators' norm options."""
    on = heads.kind == "eagle3" and any(getattr(heads.config, k) for k in NORM_OPTIONS)
    return NORMS_KIND if on else heads.kind


def dflash_layers_of(target_dir: Path) -> str:
    """DFlash's default layers, or on a shallow target two that the engines capture (1..L-1) and
    that an off-by-one control can shift without repeating a layer."""
    from headway.feature_layers import dflash_layers

    L = int(json.loads((target_dir / "config.json").read_text())["num_hidden_layers"])
    layers = dflash_layers(L) if L > 6 else [L - 2, L - 1]
    return "[" + ",".join(map(str, layers)) + "]"


# -- probe drafters --------------------------------------------------------------------------------
def constant_direction_mlp(layer, u, scale: float) -> None:
    """MLP(n) = scale * u * sum_j n_j^2: neuron pairs (e_j, -e_j) give silu(z)z + silu(-z)(-z) = z^2."""
    import torch

    H, inter = u.numel(), layer.mlp.gate_proj.weight.shape[0]
    m = min(H, inter // 2)
    gate = torch.zeros(inter, H)
    gate[torch.arange(m), torch.arange(m)] = 1.0
    gate[m + torch.arange(m), torch.arange(m)] = -1.0
    layer.mlp.gate_proj.weight.copy_(gate)
    layer.mlp.up_proj.weight.copy_(gate)
    down = torch.zeros(H, inter)
    down[:, : 2 * m] = scale * u[:, None] / m
    layer.mlp.down_proj.weight.copy_(down)
    for p in layer.self_attn.parameters():
        p.zero_()
    layer.post_attention_layernorm.weight.fill_(1.0)


def direction_for(lm_head_weight, token: int, steps: int = 300):
    """A unit vector u with argmax(W u) == token, by a margin (fitted: W's rows are not orthogonal)."""
    import torch

    W = lm_head_weight.detach().float()
    u = W[token].clone().requires_grad_(True)
    opt = torch.optim.Adam([u], lr=0.05)
    with torch.enable_grad():
        for _ in range(steps):
            logits = W @ (u / u.norm())
            loss = torch.nn.functional.cross_entropy(logits[None] * 20, torch.tensor([token]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    u = (u / u.norm()).detach()
    logits = W @ u
    margin = logits[token] - logits.masked_fill(torch.arange(len(logits)) == token, -1e9).max()
    if margin <= 0:
        raise RuntimeError(f"no direction makes token {token} the argmax of the target's lm_head")
    return u, float(margin)


def probe_heads(target, kind: str, tokens: list[int], K: int):
    """Heads of `kind` whose draft is always tokens[k] at depth k+1 (EAGLE: tokens[0] at every depth)."""
    import torch

    from headway.heads import Eagle1Drafter, Eagle3Drafter, MedusaHeads

    H, V = int(target.config.hidden_size), int(target.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        if kind == "medusa":
            heads = MedusaHeads.for_target(target, num_heads=K, num_layers=1, bias=True)
            for k, block in enumerate(heads.blocks):
                block.layers[0].weight.zero_()
                block.layers[0].bias.zero_()
                block.layers[0].bias[0] = 100.0  # h + silu(b): coordinate 0 is ~100 whatever h is
                heads.lm_heads[k].weight.zero_()
                heads.lm_heads[k].weight[tokens[k], 0] = 1.0
        elif kind == "eagle1":
            heads = Eagle1Drafter.for_target(target)
            heads.fc.weight.zero_()
            heads.fc.weight[:, :H] = torch.eye(H)  # x = embed(token): never zero, so its norm is defined
            u, margin = direction_for(target.get_output_embeddings().weight, tokens[0])
            constant_direction_mlp(heads.layers[0], u, scale=max(100.0, 50.0 / margin))
        else:
            ids = sorted(set(range(0, V, 2)) | {tokens[0]})[: V // 2]
            if tokens[0] not in ids:
                ids = sorted(ids[:-1] + [tokens[0]])
            heads = Eagle3Drafter.for_target(target, draft_vocab_size=len(ids))
            heads.set_draft_vocab(torch.tensor(ids))
            heads.fc.weight.zero_()
            heads.fc.weight[:, :H] = torch.eye(H)  # the lowest aux layer's state
            for norm in (heads.midlayer.input_layernorm, heads.midlayer.hidden_norm, heads.norm):
                norm.weight.fill_(1.0)
            e0 = torch.zeros(H)
            e0[0] = 1.0
            constant_direction_mlp(heads.midlayer, e0, scale=100.0)
            heads.lm_head.weight.zero_()
            heads.lm_head.weight[ids.index(tokens[0]), 0] = 10.0
    heads.metadata = {"probe": {"tokens": tokens[:K] if kind == "medusa" else tokens[:1]}}
    return heads


def probe_tokens(sequences: list[list[int]], K: int) -> list[int]:
    """The K tokens that most often follow one token in the target's greedy output."""
    from collections import Counter

    grams = Counter(tuple(s[i + 1:i + 1 + K]) for s in sequences for i in range(len(s) - K))
    return list(grams.most_common(1)[0][0])


# -- the two decoders --------------------------------------------------------------------------------
def run_headway(target, tokenizer, heads, prompts: list[list[int]], K: int, max_new: int) -> dict:
    from headway.decode import Speculator, chain

    spec = Speculator(target, tokenizer, heads.attach(target), tree=chain(K))
    ids, per_pos, drafts = [], [0] * K, 0
    for p in prompts:
        out = spec.generate(p, max_new_tokens=max_new, temperature=0.0)
        ids.append(out.ids)
        drafts += out.stats.target_forwards
        for d, n in enumerate(out.stats.accepted_per_depth[:K]):
            per_pos[d] += n
    return {"ids": ids, "per_pos": per_pos, "drafts": drafts}


def run_vllm(python: Path, work: Path, name: str, target_dir: Path, spec: dict | None,
             prompts: list[list[int]], max_new: int, timeout: int, model: Path | None = None) -> dict:
    """One vLLM engine over the prompts; `model` (a speculators export) replaces the target as what
    vLLM is asked to load."""
    job = {"target": str(target_dir), "model": str(model) if model else None, "spec": spec, "prompts": prompts,
           "max_tokens": max_new, "max_model_len": 512, "result": str(work / f"{name}.vllm.json")}
    (work / f"{name}.job.json").write_text(json.dumps(job))
    from headway.engines.vllm_client import worker_env

    env = worker_env()
    t0 = time.perf_counter()
    with open(work / f"{name}.vllm.log", "w") as log:
        rc = subprocess.run([str(python), __file__, "--worker", str(work / f"{name}.job.json")], env=env,
                            stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0:
        tail = (work / f"{name}.vllm.log").read_text().splitlines()[-25:]
        log = work / f"{name}.vllm.log"
        raise RuntimeError(f"vLLM run '{name}' failed (exit {rc}); log {log}:\n" + "\n".join(tail))
    res = json.loads(Path(job["result"]).read_text())
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def compare(name: str, hw: dict, vl: dict, base: dict, K: int, exact: bool, tol: float) -> dict:
    m = vl["metrics"]
    v_pos = [int(x) for x in (m.get(METRIC) or [0] * K)][:K]
    v_drafts = int(m.get("vllm:spec_decode_num_drafts", 0))
    h_rate = [n / max(hw["drafts"], 1) for n in hw["per_pos"]]
    v_rate = [n / max(v_drafts, 1) for n in v_pos]
    same_ids = vl["ids"] == base["ids"] == hw["ids"]
    if exact or tol == 0:  # equal counts: what every correct export has shown so far (fp32, CPU)
        acc_ok = v_pos == hw["per_pos"] and v_drafts == hw["drafts"]
    else:
        acc_ok = all(abs(a - b) <= tol for a, b in zip(h_rate, v_rate))
    return {"name": name, "ids_equal": same_ids, "acceptance_ok": acc_ok, "exact": exact,
            "headway": {"per_pos": hw["per_pos"], "drafts": hw["drafts"], "rate": [round(r, 4) for r in h_rate]},
            "vllm": {"per_pos": v_pos, "drafts": v_drafts, "rate": [round(r, 4) for r in v_rate],
                     "seconds": vl["seconds"]}}


def engine_run(fmt: str, kind: str, folder: Path, K: int) -> tuple[dict, Path | None]:
    """(speculative_config, model to load instead of the target) for an export of `fmt`."""
    if fmt == "speculators":  # vLLM reads method and verifier from the export's config
        return {"num_speculative_tokens": K}, folder
    if kind == "peagle":  # vLLM runs P-EAGLE as its EAGLE-3 drafter with parallel drafting
        return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K, "parallel_drafting": True}, None
    method = {"medusa": "medusa", "eagle1": "eagle", "eagle3": "eagle3", "dflash": "dflash"}[kind]
    return {"method": method, "model": str(folder), "num_speculative_tokens": K}, None


def supports(fmt: str, kind: str) -> bool:
    return fmt == "vllm" or kind in ("eagle3", "dflash", "peagle")


TRAINED_ONLY = ("dflash", NORMS_KIND, "peagle")  # kinds without a probe drafter here


def negative_control(python: Path, work: Path, target_dir: Path, target, tok, cases: list, prompts: list,
                     K: int, N: int, args: argparse.Namespace, fmt: str = "vllm", kind: str = "eagle3") -> dict | None:
    """The check must be able to fail: trained EAGLE-3 (or DFlash) heads exported with the aux layer
    ids one too low (the SGLang numbers given to vLLM), and EAGLE-3 heads trained with speculators'
    norms exported as if trained without them, must show different acceptance. Passes when they do."""
    from headway.heads.export import export_heads

    heads = next((h for name, h, exact in cases if case_kind(h) == kind and not exact), None)
    if heads is None:
        print(f"negative control skipped: it needs trained {kind} heads (--heads or --train-steps)", flush=True)
        return None
    name = f"negative-control-{kind}" + ("" if fmt == "vllm" else f"@{fmt}")
    folder = export_heads(heads, fmt, work / name)
    cfg = json.loads((folder / "config.json").read_text())
    note = miswrite(kind, fmt, cfg)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    spec, model = engine_run(fmt, heads.kind, folder, K)
    hw = run_headway(target, tok, heads, prompts, K, N)
    row = compare(name, hw, run_vllm(python, work, name, target_dir, spec, prompts, N, args.timeout, model),
                  {"ids": hw["ids"]}, K, False, args.tolerance)
    row["acceptance_ok"] = not row["acceptance_ok"]  # a mismatch is the expected outcome
    row["note"] = f"{note}: acceptance must differ"
    return row


def miswrite(kind: str, fmt: str, cfg: dict) -> str:
    """Make an exported config wrong in the way the negative control of `kind` needs (in place):
    aux ids one too low (EAGLE-3, DFlash), speculators' norms dropped (NORMS_KIND), the mask token
    one lower (P-EAGLE: the mask slots read another embedding). Returns what was changed."""
    if kind == NORMS_KIND:  # input_norm stays: vLLM loads it only when norm_before_fc says so
        right = {k: cfg[k] for k in ("norm_before_residual", "norm_output")}
        wrong = {k: False for k in right}
        cfg |= wrong
        return f"norm options {wrong} instead of {right}"
    if kind == "peagle":  # top level in both layouts; vLLM reads it first (then pard_token, ptd_token_id)
        right = cfg["mask_token_id"]
        cfg["mask_token_id"] = right - 1 if right > 0 else right + 1
        return f"mask_token_id {cfg['mask_token_id']} instead of {right}"
    if kind == "dflash" and fmt == "vllm":  # the reference layout numbers layers by decoder-layer output
        right = cfg["dflash_config"]["target_layer_ids"]
        wrong = cfg["dflash_config"]["target_layer_ids"] = [i - 1 for i in right]
    else:
        key = "aux_hidden_state_layer_ids" if kind == "dflash" else "eagle_aux_hidden_state_layer_ids"
        right = cfg[key]
        wrong = cfg[key] = [i - 1 for i in right]
        if "eagle_config" in cfg:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = wrong
    return f"aux ids {wrong} instead of {right}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--target", help="target folder / Hub id / 'demo' (default: cached demo, else tiny preset)")
    ap.add_argument("--heads", nargs="*", default=[], help="trained native heads checkpoints for this target")
    ap.add_argument("--kinds", nargs="*", default=["medusa", "eagle1", "eagle3", NORMS_KIND, "dflash", "peagle"],
                    help=f"kinds to check (probe drafters for all but {', '.join(TRAINED_ONLY)}; {NORMS_KIND}: "
                         "EAGLE-3 trained with speculators' three norm options; trained heads for every one)")
    ap.add_argument("--no-probes", action="store_true", help="only the trained heads")
    ap.add_argument("--formats", nargs="*", default=["vllm", "speculators"], choices=["vllm", "speculators"],
                    help="export formats to run (speculators: EAGLE-3, DFlash and P-EAGLE heads only)")
    ap.add_argument("--no-negative-control", dest="negative_control", action="store_false",
                    help="skip the runs that export trained heads wrongly (EAGLE-3 / DFlash aux ids off by one, "
                         "P-EAGLE's mask token one lower), which the acceptance check must catch")
    ap.add_argument("--venv", default=DEFAULT_VENV)
    ap.add_argument("--work", default=DEFAULT_WORK)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens of each code prompt (without --prompts)")
    ap.add_argument("--prompts", default=None,
                    help="a headway prompt source (chat:dev, a JSONL file, ...) instead of the held-out code prefixes: "
                         "heads trained on chat answers accept too little on code for the negative control to show")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=3, help="draft length (num_speculative_tokens / chain depth)")
    ap.add_argument("--train-steps", type=int, default=150,
                    help="with no trained heads for the target: distil and train each kind this many steps "
                         "first (~3 min); 0 = probes only")
    # Exact by default: in every run so far (tiny and demo targets, every kind and format) a correct
    # export gave vLLM the very counts headway had, while a 0.03 rate gap let the off-by-one aux-id
    # control through on a 4-layer target. A tolerance is for engines/hardware where float differences
    # can flip near-tied drafter argmaxes (bf16, GPUs).
    ap.add_argument("--tolerance", type=float, default=0.0,
                    help="per-position acceptance-rate gap allowed for trained heads (0 = equal counts)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per vLLM run")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return 0

    import torch

    from headway.heads import load_heads
    from headway.heads.export import export_heads
    from headway.target import load_target

    torch.set_num_threads(1)
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(Path(args.venv).expanduser())
    target_dir = find_target(args.target)
    target, tok = load_target(str(target_dir), dtype="float32", device="cpu")
    prompts = (source_prompts(tok, args.prompts, args.num_prompts) if args.prompts
               else code_prompts(tok, args.num_prompts, args.prompt_len))
    K, N = args.k, args.max_new_tokens
    print(f"target {target_dir} ({target.config.num_hidden_layers} layers x {target.config.hidden_size}); "
          f"{len(prompts)} prompts of {args.prompts or f'{args.prompt_len} code tokens'}, {N} new tokens, draft length {K}", flush=True)

    base = run_vllm(python, work, "baseline", target_dir, None, prompts, N, args.timeout)
    greedy = [p + ids for p, ids in zip(prompts, base["ids"])]
    tokens = probe_tokens(greedy, K)
    cases = [] if args.no_probes else [(f"probe-{kind}", probe_heads(target, kind, tokens, K), True)
                                       for kind in args.kinds if kind not in TRAINED_ONLY]
    trained = find_trained_heads(target_dir, args.heads)
    if not trained and args.train_steps:
        trained = train_heads(target_dir, work, args.kinds, args.train_steps, K,
                              int(target.get_output_embeddings().weight.shape[0]))
    for h in trained:
        heads = load_heads(str(h), target=target)
        if case_kind(heads) not in args.kinds:
            continue
        cases.append((f"trained-{case_kind(heads)}", heads, False))
    if not any(not exact for _, _, exact in cases):
        print("no trained heads for this target (give --heads, --train-steps N, or train into runs/): probes only",
              flush=True)

    rows, timings = [], {}
    names = [name for name, _, _ in cases]  # two trained heads of one kind (--heads): number them
    cases = [(name + (f"-{names[:i].count(name) + 1}" if names.count(name) > 1 else ""), h, e)
             for i, (name, h, e) in enumerate(cases)]
    runs = [(f"{name}" + ("" if fmt == "vllm" else f"@{fmt}"), heads, exact, fmt)
            for name, heads, exact in cases for fmt in args.formats if supports(fmt, heads.kind)]
    hw_cache: dict[int, dict] = {}  # headway's decode does not depend on the export format
    for name, heads, exact, fmt in runs:
        t0 = time.perf_counter()
        folder = export_heads(heads, fmt, work / name, target=target)
        timings[name] = round(time.perf_counter() - t0, 3)
        spec, model = engine_run(fmt, heads.kind, folder, K)
        if id(heads) not in hw_cache:
            hw_cache[id(heads)] = run_headway(target, tok, heads, prompts, K, N)
        hw = hw_cache[id(heads)]
        try:
            vl = run_vllm(python, work, name, target_dir, spec, prompts, N, args.timeout, model)
        except RuntimeError as e:
            print(e, flush=True)
            rows.append({"name": name, "ids_equal": False, "acceptance_ok": False, "error": str(e).splitlines()[0]})
            continue
        row = compare(name, hw, vl, base, K, exact, args.tolerance)
        row["export_seconds"] = timings[name]
        rows.append(row)
        print(json.dumps(row), flush=True)

    if args.negative_control:
        for kind in [k for k in ("eagle3", NORMS_KIND, "dflash", "peagle") if k in args.kinds]:
            for fmt in args.formats:
                control = negative_control(python, work, target_dir, target, tok, cases, prompts, K, N, args, fmt,
                                           kind)
                rows += [control] if control else []
    ok = all(r["ids_equal"] and r["acceptance_ok"] for r in rows)
    (work / "results.json").write_text(json.dumps({"target": str(target_dir), "k": K, "max_new_tokens": N,
                                                    "prompts": len(prompts), "probe_tokens": tokens,
                                                    "rows": rows, "ok": ok}, indent=2))
    print(f"\n{'heads (@format; none = vllm)':<40}{'ids equal':<11}"
          f"{'acceptance per position: headway | vLLM':<56}{'ok'}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<40}{'-':<11}{r['error'][:56]:<56}FAIL")
            continue
        acc = f"{r['headway']['per_pos']}/{r['headway']['drafts']} | {r['vllm']['per_pos']}/{r['vllm']['drafts']}"
        print(f"{r['name']:<40}{str(r['ids_equal']):<11}{acc:<56}"
              f"{'ok' if r['ids_equal'] and r['acceptance_ok'] else 'FAIL'}{' (exact)' if r['exact'] else ''}")
    print(f"results: {work / 'results.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
