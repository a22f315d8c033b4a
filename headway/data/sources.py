"""Prompt sources -> a list of ``Sample``s.

A source is one string:

- ``demo:train`` / ``demo:heldout``: code prefixes from the demo target's corpus;
- ``chat:train`` / ``chat:heldout``: the built-in chat instruction corpus (``chat_corpus``; no download);
- a ``.jsonl`` / ``.json`` / ``.parquet`` file of rows with ``prompt``, ``messages`` (OpenAI
  roles) or ``conversations`` (ShareGPT ``from``/``value``);
- a folder written by ``datasets.save_to_disk`` (a ``DatasetDict`` uses ``split``);
- anything else is a Hub dataset name, loaded by ``datasets`` (cached copies work offline).

Malformed rows raise ``BadRowError`` (``file:line: reason``) unless ``skip_bad_rows``, in which
case they are collected in ``SourceResult.bad`` for the caller to report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from .chat_corpus import chat_samples
from .errors import BadRowError, DataError, one_line
from .samples import Sample, normalize_row

DEMO_SPLITS = {"demo:train": "train", "demo:heldout": "heldout"}
CHAT_SPLITS = {"chat:train": "train", "chat:heldout": "heldout"}
DEFAULT_DEMO_PROMPTS = 256


@dataclass
class SourceResult:
    samples: list[Sample]
    bad: list[str] = field(default_factory=list)  # one "where: reason" per skipped row
    name: str = ""


def read_samples(source: str, *, split: str = "train", limit: int | None = None, skip_bad_rows: bool = False,
                 tokenizer: Any = None, prompt_tokens: int = 64, seed: int = 0) -> SourceResult:
    """Read and normalise every row of ``source`` (see the module docstring for the forms).

    ``seed`` only affects ``demo:`` sources; ``chat:`` prompts are fixed and ``limit`` takes a prefix."""
    if source in CHAT_SPLITS:
        return SourceResult(chat_samples(CHAT_SPLITS[source], limit), name=source)
    if source.startswith("chat:"):
        raise DataError(f"unknown built-in chat corpus '{source}'; use {' or '.join(CHAT_SPLITS)}")
    if source in DEMO_SPLITS:
        return SourceResult(demo_samples(DEMO_SPLITS[source], limit or DEFAULT_DEMO_PROMPTS, prompt_tokens,
                                         tokenizer, seed), name=source)
    path = Path(source).expanduser()
    if path.is_dir():
        rows = enumerate(_dataset_dir_rows(path, split))
        where = lambda i: f"{path}[{i}]"  # noqa: E731
    elif path.is_file():
        rows, where = _file_rows(path)
    elif source.startswith((".", "/", "~")) or path.suffix in (".jsonl", ".json", ".parquet"):
        raise DataError(f"prompt source not found: {path}")
    else:
        rows = enumerate(_hub_rows(source, split))
        where = lambda i: f"{source}[{i}]"  # noqa: E731
    return _normalise(rows, where, limit, skip_bad_rows, str(source))


def _normalise(rows: Iterable[tuple[int, Any]], where: Any, limit: int | None, skip_bad_rows: bool,
               name: str) -> SourceResult:
    result = SourceResult([], name=name)
    for i, row in rows:
        try:
            if isinstance(row, BadRowError):
                raise row
            result.samples.append(normalize_row(row, i, where(i)))
        except BadRowError as e:
            if not skip_bad_rows:
                raise BadRowError(f"{e} (pass --skip-bad-rows to skip bad rows)") from None
            result.bad.append(str(e))
        if limit is not None and len(result.samples) >= limit:
            break
    return result


def _file_rows(path: Path) -> tuple[Iterable[tuple[int, Any]], Any]:
    suffix = path.suffix.lower()
    if suffix == ".json":
        data = _json_document(path)
        if data is not None:
            return enumerate(data), lambda i: f"{path}[{i}]"
    if suffix in (".jsonl", ".json"):  # a .json file that is not one document is read as JSON lines
        return _jsonl_rows(path), lambda i: f"{path}:{i + 1}"
    if suffix == ".parquet":
        return enumerate(_parquet_rows(path)), lambda i: f"{path}[{i}]"
    raise DataError(f"{path}: unsupported prompt file type '{suffix}'; use .jsonl, .json or .parquet")


def _json_document(path: Path) -> list[Any] | None:
    """Rows of a ``.json`` file holding one array (or ``{"data": [...]}``); None if it is JSON lines."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 ({one_line(e)})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        return data["data"]
    return data if isinstance(data, list) else [data]


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line index, parsed row or the BadRowError for that line); blank lines are skipped."""
    with path.open("r", encoding="utf-8", errors="strict") as f:
        i = 0
        while True:
            try:
                line = f.readline()
            except UnicodeDecodeError as e:
                yield i, BadRowError(f"{path}:{i + 1}: not UTF-8 ({one_line(e)})")
                return
            if not line:
                return
            if line.strip():
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, BadRowError(f"{path}:{i + 1}: invalid JSON: {e.msg} (column {e.colno})")
            i += 1


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a broken file
        raise DataError(f"{path}: cannot read parquet: {one_line(e)}") from None
    for batch in pf.iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def _dataset_dir_rows(path: Path, split: str) -> Iterator[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{path}: not a dataset folder written by datasets.save_to_disk ({one_line(e)})") from None
    yield from _pick_split(ds, split, str(path))


def _pick_split(ds: Any, split: str, name: str) -> Any:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in ds:
            raise DataError(f"{name} has no split '{split}' (splits: {', '.join(ds)}); pass --split")
        return ds[split]
    return ds


def _hub_rows(name: str, split: str) -> Iterator[dict[str, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except (ConnectionError, OSError) as e:
        raise DataError(f"'{name}' is neither a local file or folder nor a cached Hub dataset, and the Hub "
                        f"cannot be reached ({one_line(e, 160)}); pass a .jsonl/.json/.parquet file or a "
                        "datasets folder, or download the dataset while online") from None
    except ValueError as e:  # unknown split, bad config
        raise DataError(f"cannot load Hub dataset '{name}': {one_line(e)}") from None
    except Exception as e:  # DatasetNotFoundError and friends
        raise DataError(f"cannot load Hub dataset '{name}': {type(e).__name__}: {one_line(e)}") from None
    yield from ds


def demo_samples(split: str, n: int, prompt_tokens: int, tokenizer: Any, seed: int) -> list[Sample]:
    """Code prefixes from the demo target's train / held-out stdlib files, as plain prompts."""
    from ..demo_target import demo_prompts  # lazy: the demo target module is heavy and optional

    if tokenizer is None:
        raise DataError("demo prompt sources need the target's tokenizer")
    texts = demo_prompts(split, n, prompt_tokens, tokenizer, seed)
    return [Sample(f"demo:{split}:{i}", prompt=t) for i, t in enumerate(texts)]
