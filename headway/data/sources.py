"""Prompt sources -> a list of ``Sample``s.

A source is one string:

- ``demo:train`` / ``demo:heldout``: code prefixes from the demo target's corpus;
- ``chat:train`` / ``chat:extra`` / ``chat:heldout`` / ``chat:dev``: the built-in chat instruction corpus
  (``chat_corpus``; no download); ``chat:extra`` is more prompts of the train families (none repeats a train
  prompt); ``chat:dev`` is the held-out split's tail, for evaluation and calibration, never benchmarked;
- a ``.jsonl`` / ``.json`` / ``.parquet`` file of rows with ``prompt``, ``messages`` (OpenAI
  roles) or ``conversations`` (ShareGPT ``from``/``value``);
- a folder written by ``datasets.save_to_disk`` (a ``DatasetDict`` uses ``split``);
- anything else is a Hub dataset name, loaded by ``datasets`` (cached copies work offline).

Malformed rows raise ``BadRowError`` (``file:line: reason``) unless ``skip_bad_rows``, in which
case they are collected in ``SourceResult.bad`` for the caller to report.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from .chat_corpus import chat_samples
from .errors import BadRowError, DataError, one_line
from .samples import Sample, normalize_row

DEMO_SPLITS = {"demo:train": "train", "demo:heldout": "heldout"}
CHAT_SPLITS = {"chat:train": "train", "chat:extra": "extra", "chat:heldout": "heldout", "chat:dev": "dev"}
DEFAULT_DEMO_PROMPTS = 256


SHOWN_BAD_ROWS = 5  # skipped rows named on the terminal; the output's manifest lists every one


@dataclass
class SourceResult:
    samples: list[Sample]
    bad: list[str] = field(default_factory=list)  # one "where: reason" per skipped row
    name: str = ""


def bad_rows_report(bad: list[str], manifest: Path) -> str:
    """What the terminal says of skipped rows: the first ``SHOWN_BAD_ROWS``, one a line, and how many
    more there are, which ``manifest`` lists under ``bad_rows`` (every one, with its line)."""
    lines = [f"skipped {len(bad)} bad row(s):", *(f"  {b}" for b in bad[:SHOWN_BAD_ROWS])]
    if len(bad) > SHOWN_BAD_ROWS:
        lines.append(f"  ... and {len(bad) - SHOWN_BAD_ROWS} more: every bad row is listed under 'bad_rows' in "
                     f"{manifest}")
    return "\n".join(lines)


def read_samples(source: str, *, split: str = "train", limit: int | None = None, skip_bad_rows: bool = False,
                 tokenizer: Any = None, prompt_tokens: int = 64, seed: int = 0, skip: int = 0) -> SourceResult:
    """Read and normalise every row of ``source`` (see the module docstring for the forms).

    ``seed`` only affects ``demo:`` sources; ``chat:`` prompts are fixed and ``limit`` takes a prefix.
    ``skip`` drops the first N usable prompts before ``limit`` applies, so a second run can take the
    prompts after those a first one used (their ids stay those of the source)."""
    if skip < 0:
        raise DataError(f"skip must be >= 0, got {skip}")
    if skip:
        more = read_samples(source, split=split, limit=None if limit is None else skip + limit,
                            skip_bad_rows=skip_bad_rows, tokenizer=tokenizer, prompt_tokens=prompt_tokens, seed=seed)
        if len(more.samples) <= skip:
            raise DataError(f"{source} has {len(more.samples)} usable prompts; skip={skip} leaves none")
        more.samples = more.samples[skip:]
        return more
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


def check_source(source: str) -> None:
    """Refuse at once, without reading it, a source that cannot be read: a missing or unsupported
    file, an unknown built-in corpus. Commands call it before loading a target (which can take
    minutes). Any other name is a Hub dataset, which only ``read_samples`` can tell."""
    if source in CHAT_SPLITS or source in DEMO_SPLITS:
        return
    for prefix, splits in (("chat:", CHAT_SPLITS), ("demo:", DEMO_SPLITS)):
        if source.startswith(prefix):
            raise DataError(f"unknown built-in prompt source '{source}'; use {' or '.join(splits)}")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{path}: unsupported prompt file type '{path.suffix}'; use .jsonl, .json or .parquet")
    if not path.exists() and (source.startswith((".", "/", "~")) or path.suffix in (".jsonl", ".json", ".parquet")):
        raise DataError(f"prompt source not found: {path}")


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
        doc = _json_document(path)
        if doc is not None:
            return doc
    if suffix in (".jsonl", ".json"):  # a .json file that is not one document is read as JSON lines
        return _jsonl_rows(path), lambda i: f"{path}:{i + 1}"
    if suffix == ".parquet":
        return enumerate(_parquet_rows(path)), lambda i: f"{path}[{i}]"
    raise DataError(f"{path}: unsupported prompt file type '{suffix}'; use .jsonl, .json or .parquet")


def _decode_line(raw: bytes, path: Path, i: int) -> str | BadRowError:
    """One line's bytes -> text, or the BadRowError naming its true line (``i`` is 0-based)."""
    try:
        return raw.decode("utf-8-sig" if i == 0 else "utf-8")  # a BOM may open the file, nowhere else
    except UnicodeDecodeError as e:
        return BadRowError(f"{path}:{i + 1}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})")


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line index, parsed row or the BadRowError for that line); blank lines are skipped.

    Bytes are split on b"\\n" and each line decoded on its own: a text-mode reader decodes in
    chunks, so one bad byte was reported hundreds of lines early and ended the file there."""
    with path.open("rb") as f:
        for i, raw in enumerate(f):
            line = _decode_line(raw, path, i)
            if isinstance(line, BadRowError):
                yield i, line
            elif line.strip():
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, BadRowError(f"{path}:{i + 1}: invalid JSON: {e.msg} (column {e.colno})")


_WS = re.compile(r"[ \t\n\r]*")
_DATA_KEY = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"data"[ \t\n\r]*:[ \t\n\r]*(?=\[)')
_UNDECODED = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a byte that is not UTF-8


def _json_document(path: Path) -> tuple[list[tuple[int, Any]], Any] | None:
    """(rows, where) of a ``.json`` file holding one array (or ``{"data": [...]}``); None if it is JSON lines.

    Array elements are parsed one at a time so each row knows its line. Bytes that are not UTF-8
    are decoded to lone surrogates, so the structure around them still parses: an element holding
    one is a bad row at its line, and every other row is kept."""
    lines = [r.decode("utf-8-sig" if i == 0 else "utf-8", errors="surrogateescape")
             for i, r in enumerate(path.read_bytes().split(b"\n"))]
    text = "\n".join(lines)
    line_starts = list(itertools.accumulate((len(x) + 1 for x in lines[:-1]), initial=0))
    line_at = lambda pos: bisect.bisect_right(line_starts, pos)  # noqa: E731  (1-based line of a position)

    def not_utf8(pos: int, stop: int) -> BadRowError | None:
        m = _UNDECODED.search(text, pos, stop)
        if m is None:
            return None
        line = line_at(m.start())
        return BadRowError(f"{path}:{line}: not UTF-8 (byte 0x{ord(m.group()) - 0xDC00:02x} at column "
                           f"{m.start() - line_starts[line - 1] + 1})")

    data_key = _DATA_KEY.match(text)
    start = data_key.end() if data_key else _WS.match(text).end()
    if text.startswith("[", start):
        items, end = _array_items(text, start, path, line_at)
        tail = _WS.match(text, end).end()
        if data_key and text.startswith("}", tail):
            tail = _WS.match(text, tail + 1).end()
        if tail == len(text):
            first_line = [line_at(pos) for pos, _, _ in items]
            return ([(i, not_utf8(pos, stop) or row) for i, (pos, stop, row) in enumerate(items)],
                    lambda i: f"{path}:{first_line[i]}")
        if not data_key:
            raise DataError(f"{path}:{line_at(tail)}: invalid JSON: extra data after the array")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    bad = not_utf8(0, len(text))
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        if bad:  # a "data" list among other keys: the bad byte cannot be pinned to a row
            raise DataError(str(bad))
        return list(enumerate(data["data"])), lambda i: f"{path}[{i}]"
    rows = [bad] if bad else data if isinstance(data, list) else [data]
    return list(enumerate(rows)), lambda i: f"{path}[{i}]"


def _array_items(text: str, start: int, path: Path, line_at: Callable[[int], int]
                 ) -> tuple[list[tuple[int, int, Any]], int]:
    """The elements of the JSON array opening at ``text[start]`` as (start, end, value), and the
    position after its ']'. A syntax error ends the file: past it no row boundary can be trusted."""
    decoder, items = json.JSONDecoder(), []
    pos = _WS.match(text, start + 1).end()
    if text.startswith("]", pos):
        return items, pos + 1
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        items.append((pos, end, value))
        pos = _WS.match(text, end).end()
        if text.startswith("]", pos):
            return items, pos + 1
        if not text.startswith(",", pos):
            raise DataError(f"{path}:{line_at(pos)}: invalid JSON: expected ',' or ']' after array element {len(items) - 1}")
        pos = _WS.match(text, pos + 1).end()


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
    from .stdlib_corpus import demo_prompts

    if tokenizer is None:
        raise DataError("demo prompt sources need the target's tokenizer")
    texts = demo_prompts(split, n, prompt_tokens, tokenizer, seed)
    return [Sample(f"demo:{split}:{i}", prompt=t) for i, t in enumerate(texts)]
