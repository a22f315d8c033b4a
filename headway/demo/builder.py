"""The demo target: a small Llama trained on the running interpreter's standard-library source.

No model can be downloaded on the machines headway is developed on, so the demo builds its own
target (design.md §6): a byte-level BPE tokenizer and a deep, narrow Llama (one decoder layer
costs < 1/8 of the whole model per token, as in real deployments), trained for a fixed number
of steps with a fixed seed. The result is an ordinary HF folder cached under
``<cache_dir>/targets/<preset>-<hash>``, so the second build is instant.

Files are split into train / held-out by a hash of their path; distillation prompts come from
the train files and evaluation prompts from the held-out files (``demo_prompts``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..compat import cache_kwarg
from ..config import ConfigError, check_choice
from ..data.progress import quiet_transformers
from ..data.stdlib_corpus import (HELDOUT_FRACTION, SPLITS, _corpus, _prompt_spans, _read,  # noqa: F401  (re-exported)
                                  corpus_files, corpus_identity, demo_prompts, split_of, stdlib_root)
from ..bench.repetition import repetition_rate  # noqa: F401  (re-exported)
from ..publish import check_output_path, check_replaceable, publishing, remove_dead_temps
from ..target import DEMO_METADATA_FILE, is_target_folder

# The config lives in a light module (re-exported here) so that `headway target build --help` needs no torch
from .configs import PRESETS, TargetBuildConfig, default_cache_dir  # noqa: F401
from ..hardware import bf16_is_fast
from ..progress import Progress

# Bump when the recipe changes in a way that changes the weights: old cache entries then miss.
RECIPE_VERSION = 1
METADATA_FILE = DEMO_METADATA_FILE  # the target room reads it too (bench reports the build)

# Fields that do not change the weights: they stay out of the cache key.
_NOT_IN_KEY = ("cache_dir", "force", "out", "max_minutes", "name", "gguf")


def resolve_config(cfg: TargetBuildConfig) -> TargetBuildConfig:
    """Fill unset fields from the preset (explicit values win) and check the result."""
    preset = PRESETS[cfg.preset]
    filled = {k: (v if getattr(cfg, k) is None else getattr(cfg, k)) for k, v in preset.items()}
    if cfg.bf16 is None and filled.get("bf16"):
        # a preset's bf16 is for speed: without native bf16 matmul it is ~20x slower, so not here
        filled["bf16"] = bf16_is_fast("cpu")
    if cfg.cache_dir is None:
        filled["cache_dir"] = str(default_cache_dir())
    out = dataclasses.replace(cfg, **filled)
    _validate(out)
    return out


def _validate(cfg: TargetBuildConfig) -> None:
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_position_embeddings", "seq_len", "batch_size", "steps", "eval_windows", "repetition_prompts"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"'{name}' must be positive, got {getattr(cfg, name)}")
    if cfg.vocab_size < 259:
        raise ConfigError(f"'vocab_size' must be at least 259 (3 special + 256 byte tokens), got {cfg.vocab_size}")
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"'hidden_size' ({cfg.hidden_size}) must be divisible by 'num_heads' ({cfg.num_heads})")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"'num_heads' ({cfg.num_heads}) must be divisible by 'num_kv_heads' ({cfg.num_kv_heads})")
    if cfg.seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"'seq_len' ({cfg.seq_len}) exceeds 'max_position_embeddings' "
                          f"({cfg.max_position_embeddings})")
    if cfg.lr <= 0 or cfg.warmup < 0 or cfg.max_minutes <= 0 or cfg.max_corpus_mb < 0:
        raise ConfigError("'lr' and 'max_minutes' must be positive; 'warmup' and 'max_corpus_mb' non-negative")


# ---------------------------------------------------------------------------------------------
# Corpus (the stdlib files and prompts live in data/stdlib_corpus.py, re-exported above)


def _train_texts(max_mb: float) -> list[str]:
    """Train files, or a deterministic subset of about ``max_mb`` MB of them (0 = all)."""
    files = corpus_files("train")
    if max_mb > 0:
        # Order by path hash so the subset mixes packages instead of taking the first alphabetically.
        files = sorted(files, key=lambda p: hashlib.sha1(p.relative_to(stdlib_root()).as_posix().encode()).digest())
    texts, total = [], 0
    for p in files:
        if max_mb > 0 and total >= max_mb * 1e6:
            break
        texts.append(_read(p))
        total += len(texts[-1])
    return texts


def corpus_tokens(target: str | Path, split: str) -> torch.Tensor:
    """The tokenised train or held-out stream saved with a built target (files joined by EOS)."""
    check_choice(split, SPLITS, "split")
    return torch.from_numpy(np.load(Path(target) / "corpus" / f"{split}.npy").astype(np.int64))


# ---------------------------------------------------------------------------------------------
# Measurements


def flop_layer_ratio(config: Any, context: int) -> float:
    """Per-token multiply-adds of one decoder layer / the whole model, at ``context`` cached tokens."""
    h, hd = config.hidden_size, config.hidden_size // config.num_attention_heads
    nq, nkv = config.num_attention_heads, config.num_key_value_heads
    proj = h * nq * hd * 2 + h * nkv * hd * 2  # q, o + k, v
    mlp = 3 * h * config.intermediate_size  # gate, up, down
    attn = 2 * context * nq * hd  # q.k^T and attn.v over the cache
    layer = proj + mlp + attn
    return layer / (config.num_hidden_layers * layer + h * config.vocab_size)


@torch.no_grad()
def timed_layer_ratio(model: nn.Module, context: int, steps: int = 24) -> float:
    """Median over 1-token decode steps (fp32, ``context`` cached tokens) of the mean time of one
    decoder layer divided by the whole forward, measured with hooks inside the real forward."""
    from transformers import DynamicCache

    layers = model.model.layers
    spent: list[float] = []
    starts: dict[int, float] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: starts.__setitem__(i, time.perf_counter())))
        hooks.append(layer.register_forward_hook(lambda m, a, o, i=i: spent.append(time.perf_counter() - starts[i])))
    try:
        ids = torch.randint(3, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, use_cache=True, **{cache_kwarg(): cache})
        ratios = []
        for step in range(steps):
            spent.clear()
            t0 = time.perf_counter()
            model(input_ids=ids[:, step:step + 1], use_cache=True, **{cache_kwarg(): cache})
            total = time.perf_counter() - t0
            if step >= 4:  # first steps warm up allocators
                ratios.append(sum(spent) / len(spent) / total)
    finally:
        for h in hooks:
            h.remove()
    return float(np.median(ratios))


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], new_tokens: int, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> list[int]:
    """Plain autoregressive decoding with the KV cache; no EOS stop, so lengths are comparable."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt_ids])
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, use_cache=True, **{cache_kwarg(): cache})
    result: list[int] = []
    for _ in range(new_tokens):
        logits = out.logits[0, -1].float()  # (V,)
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        result.append(int(nxt))
        out = model(input_ids=nxt[None], use_cache=True, **{cache_kwarg(): cache})
    return result


@torch.no_grad()
def heldout_loss(model: nn.Module, stream: torch.Tensor, seq_len: int, n_windows: int, batch: int = 16) -> float:
    """Mean next-token loss (fp32) on ``n_windows`` windows spread evenly over the held-out stream."""
    n_windows = max(1, min(n_windows, (len(stream) - 1) // seq_len))
    starts = torch.linspace(0, len(stream) - seq_len - 1, n_windows).long()
    total, count = 0.0, 0
    for i in range(0, n_windows, batch):
        x = stream[starts[i:i + batch, None] + torch.arange(seq_len + 1)]  # (B, T+1)
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


# ---------------------------------------------------------------------------------------------
# Building


def cache_key(cfg: TargetBuildConfig) -> str:
    cfg = resolve_config(cfg)
    recipe = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_IN_KEY}
    blob = json.dumps({"recipe": recipe, "corpus": corpus_identity(), "version": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def target_dir(cfg: TargetBuildConfig) -> Path:
    """Where the build for this config lives (whether or not it exists yet)."""
    cfg = resolve_config(cfg)
    return Path(cfg.cache_dir).expanduser() / "targets" / f"{cfg.preset}-{cache_key(cfg)}"


def read_metadata(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / METADATA_FILE).read_text())


def _is_usable(folder: Path, cfg: TargetBuildConfig) -> bool:
    """A finished build, unless its time cap fired and this call allows more time."""
    if not (folder / METADATA_FILE).is_file():
        return False
    meta = read_metadata(folder)
    return not (meta["stopped_by_time_cap"] and cfg.max_minutes > meta["max_minutes"])


def _llama(cfg: TargetBuildConfig) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         intermediate_size=cfg.intermediate_size,
                         max_position_embeddings=cfg.max_position_embeddings,
                         # untied, as in the large Llamas: heads that reuse lm_head see a separate matrix
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def _tokenize(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """One stream: every file's tokens followed by EOS."""
    eos = tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for doc in ids for t in (*doc, eos)], dtype=torch.int64)


def _save_stream(stream: torch.Tensor, path: Path, vocab_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, stream.numpy().astype(np.uint16 if vocab_size <= 2**16 else np.int32))


def _lr_lambda(warmup: int, steps: int) -> Any:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))  # cosine to 10% of peak
    return f


def _optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no weight decay on norms
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


@dataclass
class TrainResult:
    steps_done: int
    tokens_seen: int
    seconds: float
    final_loss: float
    stopped_by_time_cap: bool


def _train(model: nn.Module, stream: torch.Tensor, cfg: TargetBuildConfig, progress: bool) -> TrainResult:
    """AdamW, warm-up + cosine, random windows of the train stream; deterministic for a seed."""
    model.train()
    opt_ = _optimizer(model, cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_, _lr_lambda(cfg.warmup, cfg.steps))
    gen = torch.Generator().manual_seed(cfg.seed)
    offsets = torch.arange(cfg.seq_len + 1)
    t0, ema, step, capped = time.perf_counter(), float("nan"), 0, False
    with Progress("target training", cfg.steps, unit="steps", enabled=progress, stream=sys.stdout) as bar:
        for step in range(1, cfg.steps + 1):
            starts = torch.randint(0, len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
            x = stream[starts[:, None] + offsets]  # (B, T+1)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                logits = model(input_ids=x[:, :-1]).logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt_.step()
            opt_.zero_grad(set_to_none=True)
            sched.step()
            ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
            elapsed = time.perf_counter() - t0
            bar.advance(1, tokens=x[:, 1:].numel(), info=f"loss {ema:.3f}")
            if elapsed > cfg.max_minutes * 60 and step < cfg.steps:
                capped = True
                break
    model.eval()
    return TrainResult(step, step * cfg.batch_size * cfg.seq_len, time.perf_counter() - t0, ema, capped)


def _completion_stats(model: nn.Module, tokenizer: Any, cfg: TargetBuildConfig) -> dict[str, Any]:
    """Greedy / sampled repetition on held-out prompts, against the real continuation's rate."""
    n_prompts, p_tok, n_new = cfg.repetition_prompts, cfg.seq_len // 4, cfg.seq_len // 2  # inside the trained length
    spans = _prompt_spans("heldout", n_prompts, p_tok, tokenizer, cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    greedy, sampled, real = [], [], []
    for text, a, b in spans:
        ids = tokenizer.encode(text[a:b], add_special_tokens=False)
        greedy.append(generate(model, ids, n_new))
        sampled.append(generate(model, ids, n_new, temperature=0.8, generator=gen))
        real.append(tokenizer.encode(text[b:b + 16 * n_new], add_special_tokens=False)[:n_new])
    text, a, b = spans[0]
    return {"greedy_repetition_rate": repetition_rate(greedy), "sampled_repetition_rate": repetition_rate(sampled),
            "sample_temperature": 0.8, "reference_repetition_rate": repetition_rate(real),
            "repetition_prompts": n_prompts, "repetition_prompt_tokens": p_tok, "repetition_new_tokens": n_new,
            "sample": {"prompt": text[a:b], "greedy_completion": tokenizer.decode(greedy[0])}}


def _log(progress: bool, msg: str) -> None:
    if progress:
        from rich.console import Console

        Console(log_path=False).log(msg)


def _build_into(folder: Path, cfg: TargetBuildConfig, progress: bool) -> None:
    """Tokenizer, streams, training, evaluation, save: everything lands in ``folder``."""
    from ..tokenizer import train_bpe

    t_start = time.perf_counter()
    texts = _train_texts(cfg.max_corpus_mb)
    _log(progress, f"training a {cfg.vocab_size}-token BPE on {len(texts)} stdlib files")
    tokenizer = train_bpe(texts, cfg.vocab_size)
    train_stream = _tokenize(tokenizer, texts)
    held_stream = _tokenize(tokenizer, [_read(p) for p in corpus_files("heldout")])
    _save_stream(train_stream, folder / "corpus" / "train.npy", cfg.vocab_size)
    _save_stream(held_stream, folder / "corpus" / "heldout.npy", cfg.vocab_size)
    model = _llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    _log(progress, f"training {n_params / 1e6:.2f}M parameters for {cfg.steps} steps on "
                   f"{len(train_stream):,} tokens")
    if cfg.bf16 and not bf16_is_fast("cpu"):
        _log(progress, "bf16 was asked for, but this CPU has no fast bf16 matmul: expect a build many times "
                       "slower than with --no-bf16")
    result = _train(model, train_stream, cfg, progress)
    _log(progress, "evaluating on held-out code")
    loss = heldout_loss(model, held_stream, cfg.seq_len, cfg.eval_windows)
    meta = {
        "headway_target_version": RECIPE_VERSION,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("cache_dir", "force", "out")},
        "max_minutes": cfg.max_minutes,
        "corpus": {**corpus_identity(), "stdlib": str(stdlib_root()), "train_files": len(texts),
                   "heldout_files": len(corpus_files("heldout")), "train_tokens": len(train_stream),
                   "heldout_tokens": len(held_stream)},
        "steps_done": result.steps_done, "tokens_seen": result.tokens_seen,
        "train_seconds": round(result.seconds, 2), "tokens_per_second": round(result.tokens_seen / result.seconds, 1),
        "stopped_by_time_cap": result.stopped_by_time_cap, "final_train_loss": result.final_loss,
        "heldout_loss": loss, "heldout_perplexity": math.exp(loss),
        "heldout_eval_tokens": min(cfg.eval_windows, (len(held_stream) - 1) // cfg.seq_len) * cfg.seq_len,
        "parameters": n_params,
        "non_embedding_parameters": n_params - model.get_input_embeddings().weight.numel(),
        **_completion_stats(model, tokenizer, cfg),
        "layer_cost_ratio": {"context": cfg.seq_len, "flops": flop_layer_ratio(model.config, cfg.seq_len),
                             "timed_fp32": timed_layer_ratio(model, cfg.seq_len)},
    }
    with quiet_transformers():
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    meta["build_seconds"] = round(time.perf_counter() - t_start, 2)
    (folder / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")




def build_demo_target(cfg: TargetBuildConfig, progress: bool = True) -> Path:
    """Build the demo target (or reuse the cached build) and return its HF folder."""
    cfg = resolve_config(cfg)
    final = target_dir(cfg)
    check_copy_out(cfg.out)
    if cfg.force or not _is_usable(final, cfg):
        remove_dead_temps(final)  # what killed builds left in the cache (a target's worth each)
        # without force, a concurrent build of the same config that finished first wins
        with publishing(final, folder=True, replace=cfg.force or not _is_usable(final, cfg)) as tmp:
            _build_into(tmp, cfg, progress)
    if cfg.out:
        shutil.copytree(final, Path(cfg.out).expanduser(), dirs_exist_ok=True)
    return final


def check_copy_out(out: str | None) -> None:
    """``--out``, where ``target build`` copies the built folder, checked before the build: a new
    or empty folder, or an earlier copy of a built target (whose files the copy writes over)."""
    from .named import METADATA_FILE as NAMED_METADATA_FILE

    def is_copy(folder: Path) -> bool:
        return is_target_folder(folder) and any((folder / name).is_file() for name in (METADATA_FILE,
                                                                                      NAMED_METADATA_FILE))

    if out:
        folder = check_output_path(out, "--out", error=ConfigError)
        check_replaceable(folder, f"--out {out}", "copy of a built target", is_copy, lambda name: True, ConfigError)


def build_default(name: str = "demo") -> Path:
    """The built-in target ``demo`` (an entry point of ``headway.targets``, which
    ``headway.target.resolve_target_path`` calls): the default preset, built or reused."""
    return build_demo_target(TargetBuildConfig())


def build_assistant(target_path: str, layers: int, progress: bool) -> tuple[str, str]:
    """The demo target's recipe (same tokenizer, corpus, steps) with ``layers`` layers, built or
    reused from the cache, and a note saying so (``headway.target.default_assistant``)."""
    meta = read_metadata(target_path)
    fields = {f.name for f in dataclasses.fields(TargetBuildConfig)}
    recipe = {k: v for k, v in meta["config"].items() if k in fields}
    folder = Path(target_path)
    cache = folder.parent.parent if folder.parent.name == "targets" else default_cache_dir()
    recipe.update(num_layers=layers, cache_dir=str(cache), max_minutes=meta.get("max_minutes"))
    path = build_demo_target(TargetBuildConfig(**recipe), progress=progress)
    note = (f"the demo recipe ({recipe.get('preset')}) with {layers} of {meta['config'].get('num_layers')} layers, "
            "trained like the target (TargetBuildConfig override; demo_target has no assistant preset)")
    return str(path), note


def _summary_rows(meta: dict[str, Any], folder: Path, cfg: TargetBuildConfig, cached: bool) -> list[tuple[str, str]]:
    from rich.markup import escape

    rows = [("path", escape(str(folder)))]
    if cfg.out:
        rows.append(("copied to", escape(str(Path(cfg.out).expanduser()))))
    cost = meta["layer_cost_ratio"]
    rows += [
        ("parameters", f"{meta['parameters']:,}"),
        ("held-out loss", f"{meta['heldout_loss']:.3f} (perplexity {meta['heldout_perplexity']:.1f})"),
        ("training", f"{meta['steps_done']} steps, {meta['tokens_seen']:,} tokens, "
                     f"{meta['tokens_per_second']:,.0f} tokens/s"),
        ("greedy 4-gram repetition", f"{meta['greedy_repetition_rate']:.1%} (sampled at T=0.8 "
                                     f"{meta['sampled_repetition_rate']:.1%}, real code "
                                     f"{meta['reference_repetition_rate']:.1%})"),
        ("1 layer / whole model", f"{cost['flops']:.3f} by FLOPs, {cost['timed_fp32']:.3f} timed"),
        ("build time", "from cache" if cached else f"{meta['build_seconds']:.0f} s"),
    ]
    if meta["stopped_by_time_cap"]:
        rows.append(("note", f"[yellow]training hit max_minutes={meta['max_minutes']:g} after "
                     f"{meta['steps_done']} of {meta['config']['steps']} steps (a busy machine?); rebuild with "
                     "--force, or a larger --max_minutes[/]"))
    return rows


def build_cli(cfg: TargetBuildConfig) -> int:
    """``headway target build``: build with a progress bar, then print a short summary."""
    from rich.console import Console
    from rich.markup import escape

    check_copy_out(cfg.out)
    if cfg.name != "demo":
        return build_named_cli(cfg)
    cfg = resolve_config(cfg)
    cached = not cfg.force and _is_usable(target_dir(cfg), cfg)
    folder = build_demo_target(cfg, progress=True)
    meta = read_metadata(folder)
    console = Console(soft_wrap=True)  # never break the path or the sample across lines
    for key, value in _summary_rows(meta, folder, cfg, cached):
        console.print(f"[bold]{key:<26}[/]{value}", highlight=False)
    console.print("[bold]greedy sample[/] (prompt, then [reverse]completion[/])")
    console.print(escape(meta["sample"]["prompt"]) + "[reverse]" + escape(meta["sample"]["greedy_completion"]) + "[/]",
                  highlight=False)
    return 0


def build_named_cli(cfg: TargetBuildConfig) -> int:
    """``headway target build smollm2``: fetch + convert (or reuse the cache), then a short summary."""
    from rich.console import Console
    from rich.markup import escape

    from .named import build_named_target, is_built, named_target_dir, summary_rows

    cached = not cfg.force and is_built(named_target_dir(cfg.name, cfg.cache_dir))
    console = Console(soft_wrap=True)
    if not cached:
        console.print(f"building target '{cfg.name}' (fetch, dequantise, check logits, save)...")
    folder = build_named_target(cfg.name, cfg.cache_dir, cfg.gguf, cfg.force)
    if cfg.out:
        shutil.copytree(folder, Path(cfg.out).expanduser(), dirs_exist_ok=True)
    for key, value in summary_rows(folder) + [("build", "from cache" if cached else "built now")]:
        console.print(f"[bold]{key:<26}[/]{escape(value)}", highlight=False)
    return 0
