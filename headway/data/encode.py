"""``headway tokenize``: a dataset that already has answers -> ``input_ids`` + assistant-only loss masks.

For training on existing answers without regenerating them. The output folder has the same
layout and columns as ``headway distill``'s (``load_distilled`` reads both), with
``finish_reason = "given"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import check_numbers, opt
from ..publish import check_output_path
from ..target import require_target
from .chat import assistant_mask, require_template
from .errors import BadRowError, DataError
from .plans import OVERLONG, PROMPT_FORMATS
from .source_spec import parse_sources
from .samples import Sample

MANIFEST = "headway_tokenize.json"


@dataclass
class TokenizeConfig:
    source: Any = opt(help="rows with answers: a .jsonl/.json/.parquet file (messages | conversations | "
                           "prompt+completion | instruction+input+output), a datasets folder, a Hub dataset name, or a "
                           "source spec (as distill's: docs/data.md)", positional=True)
    output: str = opt("runs/tokenized", "output folder")
    target: str | None = opt(None, "whose tokenizer and vocabulary (required): a local folder, a Hub id, or 'demo'")
    revision: str | None = opt(None, "target revision (Hub targets)")
    chat_template: str | None = opt(None, "Jinja chat template file, for tokenizers that have none")
    prompt_format: str = opt("auto", "auto: chat template when the tokenizer has one; chat: always; "
                                     "raw: prompt + completion as plain text", choices=PROMPT_FORMATS)
    split: str = opt("train", "split of a datasets folder / Hub dataset")
    limit: int | None = opt(None, "use only the first N rows")
    max_length: int = opt(2048, "rows longer than this (tokens) are dropped or truncated")
    overlong: str = opt("drop", "what to do with a too-long row", choices=OVERLONG)
    skip_bad_rows: bool = opt(False, "skip malformed rows (and report how many) instead of stopping")
    overwrite: bool = opt(False, "delete the output folder first")

    def __post_init__(self) -> None:
        require_target(self.target)
        parse_sources(self.source)
        check_numbers(self, "", {"max_length": ">= 1", "limit": ">= 1"})


def tokenize_sample(tokenizer: Any, sample: Sample, template: str | None, prompt_format: str = "auto",
                    target: str = "target") -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a sample with answers; the mask is 1 on the answer tokens only.

    Conversations go through the chat template (``{% generation %}`` markers if it has them, else
    prefix rendering); a plain prompt + completion is ``prompt tokens + completion tokens + EOS``.
    """
    if not sample.has_answers():
        raise BadRowError(f"row '{sample.id}': no answer (no assistant message or completion); "
                          "use headway distill to have the target write one")
    messages = sample.messages
    if messages is None and (prompt_format == "chat" or (prompt_format == "auto" and template)):
        messages = [{"role": "user", "content": sample.prompt or ""},
                    {"role": "assistant", "content": sample.completion or ""}]
    if messages is not None:
        return assistant_mask(tokenizer, messages, require_template(template, target, f"row '{sample.id}'"))
    prompt = list(tokenizer(sample.prompt, add_special_tokens=True)["input_ids"])
    answer = list(tokenizer(sample.completion, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        answer.append(int(tokenizer.eos_token_id))
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def fit_length(ids: list[int], mask: list[int], max_length: int, overlong: str) -> tuple[list[int], list[int]] | None:
    """Keep a row within ``max_length``: None when dropped (or nothing to learn remains after truncation)."""
    if len(ids) <= max_length:
        return ids, mask
    if overlong == "drop" or not any(mask[:max_length]):
        return None
    return ids[:max_length], mask[:max_length]


def tokenize_dataset(cfg: TokenizeConfig) -> Path:
    """Tokenise ``cfg.source`` into ``cfg.output`` (not sharded: tokenisation is fast)."""
    from datasets import Dataset

    from ..target import load_config_only, load_tokenizer
    from .chat import load_chat_template
    from .distill import prepare_output, row_features, save_merged
    from .progress import console, quiet_datasets
    from .shards import write_json
    from .sources import bad_rows_report, check_source, read_samples, source_paths
    from ..target import resolve_target_path
    from .vocab import save_token_counts, token_frequencies

    start = time.perf_counter()
    out = Path(cfg.output).expanduser()
    check_source(cfg.source)  # a missing file is refused before the target's tokenizer loads
    check_output_path(out, "output folder", inputs=[*source_paths(cfg.source), cfg.target, cfg.chat_template],
                      error=DataError)  # never emptied by --overwrite
    prepare_output(out, cfg.overwrite, MANIFEST)
    target_path = resolve_target_path(cfg.target)
    tokenizer = load_tokenizer(target_path, target_path, cfg.revision, trust_remote_code=False)
    vocab_size = int(load_config_only(target_path, cfg.revision).get_text_config().vocab_size)
    template = load_chat_template(tokenizer, cfg.chat_template)
    src = read_samples(cfg.source, split=cfg.split, limit=cfg.limit, skip_bad_rows=cfg.skip_bad_rows)
    rows, bad, dropped, truncated = [], list(src.bad), 0, 0
    for i, sample in enumerate(src.samples):
        try:
            ids, mask = tokenize_sample(tokenizer, sample, template, cfg.prompt_format, cfg.target)
        except BadRowError as e:
            if not cfg.skip_bad_rows:
                raise BadRowError(f"{e} (pass --skip-bad-rows to skip bad rows)") from None
            bad.append(str(e))
            continue
        fitted = fit_length(ids, mask, cfg.max_length, cfg.overlong)
        dropped += fitted is None
        truncated += fitted is not None and len(fitted[0]) < len(ids)
        if fitted is not None:
            rows.append({"index": i, "id": sample.id, "input_ids": fitted[0], "loss_mask": fitted[1],
                         "finish_reason": "given"})
    if not rows:
        first = f"; the first bad one: {bad[0]}" if bad else ""
        raise DataError(f"no usable rows in {cfg.source} ({len(bad)} bad, {dropped} too long{first})")
    out.mkdir(parents=True, exist_ok=True)
    with quiet_datasets():
        ds = Dataset.from_list(rows, features=row_features())
        save_merged(ds, out)
    save_token_counts(out, token_frequencies(ds, vocab_size))
    tokens = sum(len(r["input_ids"]) for r in rows)
    write_json(out / MANIFEST, {"format": "headway-distilled", "complete": True, "source": cfg.source,
                                "target": cfg.target, "revision": cfg.revision, "rows": len(rows),
                                "tokens": tokens, "answer_tokens": sum(sum(r["loss_mask"]) for r in rows),
                                "dropped": dropped, "truncated": truncated, "bad_rows_skipped": len(bad),
                                "bad_rows": bad})
    console().print(f"tokenized {len(rows)} rows ({tokens} tokens, {dropped} dropped, {truncated} truncated) "
                    f"into {out} in {time.perf_counter() - start:.1f}s")
    if bad:  # file:line text, printed as it is (no markup, no wrapping)
        console().print(bad_rows_report(bad, out / MANIFEST), markup=False, highlight=False, soft_wrap=True)
    return out


def tokenize_cli(cfg: TokenizeConfig) -> int:
    tokenize_dataset(cfg)
    return 0
