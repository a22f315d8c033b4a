"""Prompt sources -> a list of ``Sample``s.

A source is one string:

- ``demo:train`` / ``demo:heldout``: code prefixes from the demo target's corpus;
- ``chat:train`` / ``chat:extra`` / ``chat:heldout`` / ``chat:dev`` / ``chat:test``: the built-in chat
  instruction corpus (``chat_corpus``: files shipped in the package; no download); ``chat:extra`` is more prompts of the train families (none repeats a train
  prompt); ``chat:dev`` is the held-out split's tail, for evaluation and calibration, never benchmarked;
  ``chat:test`` is new prompts of the held-out families that no choice reads, for reported numbers;
- a ``.jsonl`` / ``.json`` / ``.parquet`` file of rows with ``prompt``, ``messages`` (OpenAI
  roles) or ``conversations`` (ShareGPT ``from``/``value``);
- a folder written by ``datasets.save_to_disk`` (a ``DatasetDict`` uses ``split``);
- anything else is a Hub dataset name, loaded by ``datasets`` (cached copies work offline).

A source may also be a ``SourceSpec`` (``source_spec``): a Hub dataset's config, split and
``data_files``, a column mapping and row format, a seeded shuffle and sample, streaming, or a list of
them mixed by weight. A one-string source reads exactly as before.

Malformed rows raise ``BadRowError`` (``file:line: reason``) unless ``skip_bad_rows``, in which
case they are collected in ``SourceResult.bad`` for the caller to report.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import itertools
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..config import ConfigError
from .chat_corpus import chat_samples
from .errors import BadRowError, DataError, one_line
from .samples import Sample, normalize_row
from .source_spec import FILE_SUFFIXES, FORMAT_FIELDS, SourceSpec, parse_sources

DEMO_SPLITS = {"demo:train": "train", "demo:heldout": "heldout"}
CHAT_SPLITS = {"chat:train": "train", "chat:extra": "extra", "chat:heldout": "heldout", "chat:dev": "dev",
               "chat:test": "test"}
DEFAULT_DEMO_PROMPTS = 256
STREAM_SHUFFLE_BUFFER = 10_000


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


def read_samples(source: Any, *, split: str = "train", limit: int | None = None, skip_bad_rows: bool = False,
                 tokenizer: Any = None, prompt_tokens: int = 64, seed: int = 0, skip: int = 0) -> SourceResult:
    """Read and normalise the rows of ``source``: a string (see the module docstring for the forms),
    a mapping or ``SourceSpec``, or a list of them (a weighted mix).

    ``seed`` only affects ``demo:`` sources (a spec's shuffle has its own); ``limit`` takes a prefix
    of the (shuffled, mixed) stream. ``skip`` drops the first N usable prompts before ``limit``
    applies, so a second run can take the prompts after those a first one used (their ids stay those
    of the source)."""
    if skip < 0:
        raise DataError(f"skip must be >= 0, got {skip}")
    if skip:
        more = read_samples(source, split=split, limit=None if limit is None else skip + limit,
                            skip_bad_rows=skip_bad_rows, tokenizer=tokenizer, prompt_tokens=prompt_tokens, seed=seed)
        if len(more.samples) <= skip:
            raise DataError(f"{_name(source)} has {len(more.samples)} usable prompts; skip={skip} leaves none")
        more.samples = more.samples[skip:]
        return more
    specs = _specs(source)
    result = SourceResult([], name=_name(source))
    streams = [_stream(spec, split, skip_bad_rows, tokenizer, prompt_tokens, seed, limit, result.bad)
               for spec in specs]
    if len(specs) == 1:
        result.samples = list(itertools.islice(streams[0], limit))
    else:
        result.samples = _mix(specs, streams, limit)
    return result


def _specs(source: Any) -> list[SourceSpec]:
    try:
        return parse_sources(source)
    except ConfigError as e:
        raise DataError(str(e)) from None


def _name(source: Any) -> str:
    """How a source is named in messages: a string as written, a spec by its label, else its JSON."""
    if isinstance(source, str):
        return source
    if isinstance(source, SourceSpec):
        return source.label()
    return json.dumps(source, default=str)


def _stream(spec: SourceSpec, split: str, skip_bad_rows: bool, tokenizer: Any, prompt_tokens: int, seed: int,
            limit: int | None, bad: list[str]) -> Iterator[Sample]:
    """The usable samples of one source, in order (shuffled if asked), at most ``spec.sample``."""
    split = spec.split or split
    count = min((n for n in (spec.sample, limit) if n is not None), default=None)
    source = spec.path
    if spec.builtin:
        samples = _builtin(source, split, None if spec.shuffle else count, tokenizer, prompt_tokens, seed)
        if spec.shuffle:
            random.Random(spec.seed).shuffle(samples)
        return iter(samples[:count])
    path = Path(source).expanduser()
    _check_one(spec)
    if spec.hub:
        rows = _hub_rows(spec, split)
        where = lambda i: f"{spec.label()}[{i}]"  # noqa: E731
        if spec.shuffle and not spec.streaming:
            rows = _shuffled(rows, spec.seed)
    else:
        if path.is_dir():
            rows = _Indexed(_dataset_dir(path, split))
            where = lambda i: f"{path}[{i}]"  # noqa: E731
        else:
            rows, where = _file_rows(path)
        if spec.shuffle:
            rows = _shuffled(rows, spec.seed)
    rows = ((i, _mapped(row, spec)) for i, row in rows)
    return itertools.islice(_samples(rows, where, skip_bad_rows, bad), count)


def _builtin(source: str, split: str, limit: int | None, tokenizer: Any, prompt_tokens: int,
             seed: int) -> list[Sample]:
    if source in CHAT_SPLITS:
        return chat_samples(CHAT_SPLITS[source], limit)
    if source in DEMO_SPLITS:
        return demo_samples(DEMO_SPLITS[source], limit or DEFAULT_DEMO_PROMPTS, prompt_tokens, tokenizer, seed)
    splits = CHAT_SPLITS if source.startswith("chat:") else DEMO_SPLITS
    kind = "chat corpus" if source.startswith("chat:") else "prompt source"
    raise DataError(f"unknown built-in {kind} '{source}'; use {' or '.join(splits)}")


def _shuffled(rows: Iterable[tuple[int, Any]], seed: int) -> Iterator[tuple[int, Any]]:
    """The rows in a seeded random order; each keeps its index, so a bad row is still named by its line."""
    if isinstance(rows, _Indexed):  # a datasets table: shuffle the indices, read rows on demand
        order = list(range(len(rows.ds)))
        random.Random(seed).shuffle(order)
        return ((i, rows.ds[i]) for i in order)
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return iter(rows)


def _mapped(row: Any, spec: SourceSpec) -> Any:
    """A row as ``normalize_row`` reads it: ``columns`` renamed to headway's field names, an explicit
    ``format`` keeping only its own fields (so a row without them is a bad row, not another format)."""
    if not isinstance(row, dict) or (not spec.columns and spec.format == "auto"):
        return row
    mapped = {**row, **{field: row[column] for field, column in spec.columns.items() if column in row}}
    if spec.format != "auto":
        keep = ("id", *FORMAT_FIELDS[spec.format])
        mapped = {k: v for k, v in mapped.items() if k in keep or k not in _ALL_FIELDS}
        main = FORMAT_FIELDS[spec.format][0]
        if main not in mapped:
            return BadRowError(f"no '{spec.columns.get(main, main)}' field, which format {spec.format} reads "
                               f"(fields: {', '.join(sorted(map(str, row))) or 'none'}); map it with columns")
    return mapped


_ALL_FIELDS = frozenset(f for fs in FORMAT_FIELDS.values() for f in fs)


def _mix(specs: list[SourceSpec], streams: list[Iterator[Sample]], limit: int | None) -> list[Sample]:
    """Interleave the sources by weight: each next row comes from the source furthest below its share
    (stride scheduling), so every prefix holds the shares and ``limit`` / ``skip`` cut the same mix.
    The mix ends at the first row it needs from a source that has none left. Ids (``<source>:<row id>``)
    and ``meta["source"]`` name the source a row came from."""
    labels = [s.label() for s in specs]
    taken = [0] * len(specs)
    out: list[Sample] = []
    while limit is None or len(out) < limit:
        k = min(range(len(specs)), key=lambda j: ((taken[j] + 1) / specs[j].weight, j))
        sample = next(streams[k], None)
        if sample is None:
            break
        out.append(dataclasses.replace(sample, id=f"{labels[k]}:{sample.id}",
                                       meta={**sample.meta, "source": labels[k]}))
        taken[k] += 1
    return out


def check_source(source: Any) -> None:
    """Refuse at once, without reading it, a source that cannot be read: a spec with a bad key or
    value, a missing or unsupported file, an unknown built-in corpus. Commands call it before
    loading a target (which can take minutes). Any other name is a Hub dataset, which only
    ``read_samples`` can tell."""
    for spec in _specs(source):
        _check_one(spec)


def source_paths(source: Any) -> list[str]:
    """The local paths (or Hub names) a source reads: what an output folder must never replace."""
    return [spec.path for spec in _specs(source) if not spec.builtin]


def _check_one(spec: SourceSpec) -> None:
    source = spec.path
    if source in CHAT_SPLITS or source in DEMO_SPLITS:
        return
    for prefix, splits in (("chat:", CHAT_SPLITS), ("demo:", DEMO_SPLITS)):
        if source.startswith(prefix):
            raise DataError(f"unknown built-in prompt source '{source}'; use {' or '.join(splits)}")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() not in FILE_SUFFIXES:
        raise DataError(f"{path}: unsupported prompt file type '{path.suffix}'; use .jsonl, .json or .parquet")
    if not path.exists() and (source.startswith((".", "/", "~")) or path.suffix in FILE_SUFFIXES):
        raise DataError(f"prompt source not found: {path}")
    if path.is_file() and spec.data_files:
        raise DataError(f"{path} is a file: data_files ({', '.join(spec.data_files)}) pick files inside a folder or "
                        "a Hub dataset; give the file alone, or its folder with data_files")
    _check_data_files(spec, path)


def _check_data_files(spec: SourceSpec, path: Path) -> None:
    """Each local ``data_files`` pattern matches a file: relative to the source's folder, or to the
    current folder for a loader name (json, parquet, ...). A Hub dataset's patterns name files of
    the repo, which only ``datasets`` can list."""
    if path.is_dir():
        base, where = path, f" in {path}"
    elif "/" not in spec.path:  # a datasets loader: its data_files are local paths (or URLs)
        base, where = Path.cwd(), ""
    else:
        return
    for pattern in spec.data_files:
        matches = glob.iglob(os.path.join(glob.escape(str(base)), os.path.expanduser(pattern)), recursive=True)
        if "://" not in pattern and not any(os.path.isfile(m) for m in matches):
            raise DataError(f"data_files '{pattern}' matches no file{where}")


def _samples(rows: Iterable[tuple[int, Any]], where: Any, skip_bad_rows: bool, bad: list[str]) -> Iterator[Sample]:
    """Each row normalised; a bad row raises (naming it, and how to skip it) or goes to ``bad``."""
    for i, row in rows:
        try:
            if isinstance(row, BadRowError):
                raise row if str(row).startswith(str(where(i))) else BadRowError(f"{where(i)}: {row}")
            yield normalize_row(row, i, where(i))
        except BadRowError as e:
            if not skip_bad_rows:
                raise BadRowError(f"{e} (pass --skip-bad-rows to skip bad rows)") from None
            bad.append(str(e))


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


def _dataset_dir(path: Path, split: str) -> Any:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"{path}: not a dataset folder written by datasets.save_to_disk ({one_line(e)})") from None
    return _pick_split(ds, split, str(path))


def _pick_split(ds: Any, split: str, name: str) -> Any:
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        if split not in ds:
            raise DataError(f"{name} has no split '{split}' (splits: {', '.join(ds)}); pass --split")
        return ds[split]
    return ds


class _Indexed:
    """(index, row) pairs of a datasets table; a shuffle reads its rows by index instead of listing them."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return enumerate(self.ds)


def _hub_rows(spec: SourceSpec, split: str) -> Iterable[tuple[int, Any]]:
    ds = _load_hub(spec, split)
    if spec.streaming:
        if spec.shuffle:  # a stream cannot be permuted: draw from a seeded buffer instead
            ds = ds.shuffle(seed=spec.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
        return enumerate(ds)
    return _Indexed(ds)


def _load_hub(spec: SourceSpec, split: str) -> Any:
    """``datasets.load_dataset`` of a spec. Where datasets cannot reach the Hub (offline, no network),
    the files may still be in the Hub cache (``datasets--org--name/snapshots/<sha>``, what an online
    load downloaded): then they are loaded from that folder, configs and all."""
    import datasets

    kwargs = {"name": spec.config, "split": split, "data_files": spec.data_files or None,
              "streaming": spec.streaming}
    try:
        return _load(datasets, spec.path, spec, kwargs)
    except _Unreachable as e:
        unreachable = e
    folder = _cached_snapshot(spec.path)
    if folder is None:
        raise DataError(f"'{spec.path}' is neither a local file or folder nor a cached Hub dataset, and the Hub "
                        f"cannot be reached ({one_line(unreachable, 160)}); pass a .jsonl/.json/.parquet file or a "
                        "datasets folder, or download the dataset while online") from None
    try:
        return _load(datasets, str(folder), spec, kwargs)
    except _Unreachable as e:
        raise DataError(f"cannot load Hub dataset '{spec.label()}' from its cached files {folder}: "
                        f"{one_line(e)}") from None


class _Unreachable(Exception):
    pass


def _load(datasets: Any, path: str, spec: SourceSpec, kwargs: dict[str, Any]) -> Any:
    try:
        return datasets.load_dataset(path, **kwargs)
    except (ConnectionError, OSError) as e:
        raise _Unreachable(e) from None
    except ValueError as e:  # unknown split, bad config
        raise DataError(f"cannot load Hub dataset '{spec.label()}': {one_line(e)}") from None
    except Exception as e:  # DatasetNotFoundError and friends
        raise DataError(f"cannot load Hub dataset '{spec.label()}': {type(e).__name__}: {one_line(e)}") from None


def _cached_snapshot(name: str) -> Path | None:
    """The Hub cache's snapshot folder of dataset ``name`` (no download), or None."""
    from ..target import TargetError, resolve_folder

    if name.count("/") != 1:
        return None
    try:
        return resolve_folder(name, repo_type="dataset", local_files_only=True, what="dataset")
    except TargetError:
        return None


def demo_samples(split: str, n: int, prompt_tokens: int, tokenizer: Any, seed: int) -> list[Sample]:
    """Code prefixes from the demo target's train / held-out stdlib files, as plain prompts."""
    from .stdlib_corpus import demo_prompts

    if tokenizer is None:
        raise DataError("demo prompt sources need the target's tokenizer")
    texts = demo_prompts(split, n, prompt_tokens, tokenizer, seed)
    return [Sample(f"demo:{split}:{i}", prompt=t) for i, t in enumerate(texts)]


# ---------------------------------------------------------------------------------------------
# Raw rows, for readers with a row format of their own (``headway eval``'s suites)


def table_rows(path: Path, split: str = "train") -> Iterator[tuple[str, Any]]:
    """(location, raw row) of a ``.jsonl`` / ``.json`` / ``.parquet`` file or a ``save_to_disk``
    folder (``split`` of a ``DatasetDict``), unnormalised; a malformed row raises ``BadRowError``."""
    if path.is_dir():
        for i, row in enumerate(_dataset_dir(path, split)):
            yield f"{path}[{i}]", row
        return
    rows, where = _file_rows(path)
    for i, row in rows:
        if isinstance(row, BadRowError):
            raise row
        yield where(i), row


def dataset_on_disk(name: str) -> bool:
    """Whether Hub dataset ``name`` is on this machine already (the Hub cache's snapshot or
    ``datasets``' own cache), so that reading it downloads nothing."""
    import datasets

    if _cached_snapshot(name) is not None:
        return True
    return (Path(datasets.config.HF_DATASETS_CACHE) / name.replace("/", "___")).is_dir()


def dataset_rows(name: str, config: str | None, split: str) -> Iterator[tuple[str, Any]]:
    """(location, raw row) of a Hub dataset's split, read as ``read_samples`` reads one."""
    spec = SourceSpec(path=name, config=config)
    for i, row in enumerate(_load_hub(spec, split)):
        yield f"{spec.label()}[{i}]", row
