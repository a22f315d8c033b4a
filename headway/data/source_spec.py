"""What a prompt source is: ``SourceSpec``, and the forms a user writes it in.

A source is one string, as before (``chat:train``, ``demo:heldout``, ``prompts.jsonl``, a
``save_to_disk`` folder, a Hub dataset name), or a spec with more to say:

- on the command line, ``org/name:config@split`` (each part optional), ``preset:ultrachat``, or a
  YAML flow mapping / list: ``'{path: org/name, split: train_sft, sample: 2000, shuffle: true}'``;
- in a YAML config, a mapping (``source: {path: ..., columns: {prompt: question}}``) or a list of
  them: a weighted mix (``weight``; the mix interleaves its sources in proportion, so every prefix
  holds the shares, and ends at the first row it needs from a source that has none left).

Every form becomes a ``SourceSpec`` (checked as any headway config: unknown keys are errors that
name the valid ones) before anything is read. Light at import: ``--help`` and config checks read it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import ConfigError, from_dict, opt

BUILTIN_PREFIXES = ("chat:", "demo:")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
FORMATS = ("auto", "prompt", "messages", "sharegpt", "alpaca")
# the fields of a row each format reads (``columns`` maps them to the dataset's own names)
FORMAT_FIELDS = {"prompt": ("prompt", "completion"), "messages": ("messages",), "sharegpt": ("conversations",),
                 "alpaca": ("instruction", "input", "output")}
FIELDS = ("id", *dict.fromkeys(f for fs in FORMAT_FIELDS.values() for f in fs))
# Named sources: the datasets the reference toolkits distil from. Other keys override them.
PRESETS: dict[str, dict[str, Any]] = {
    "sharegpt": {"path": "Aeala/ShareGPT_Vicuna_unfiltered", "data_files": ["ShareGPT_V4.3_unfiltered_cleaned_split.json"],
                 "split": "train", "format": "sharegpt"},
    "ultrachat": {"path": "HuggingFaceH4/ultrachat_200k", "split": "train_sft", "format": "messages"},
}
# NAME[:CONFIG][@SPLIT] for a Hub dataset (NAME is org/name or a loader such as json / parquet)
_HUB = re.compile(r"(?P<path>[\w.-]+(?:/[\w.-]+)?)(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?")


@dataclass
class SourceSpec:
    path: str = opt("", "a .jsonl/.json/.parquet file, a datasets folder, a Hub dataset name (or a datasets loader "
                        "such as json / parquet with data_files), or a built-in source (chat:train, demo:train, ...)")
    preset: str | None = opt(None, "a named dataset: its path, split, files and format (other keys override them)",
                             choices=tuple(PRESETS))
    config: str | None = opt(None, "Hub dataset configuration name (load_dataset's `name`)")
    split: str | None = opt(None, "split to read (default: the command's --split)")
    data_files: list[str] = opt(default_factory=list, help="files inside the dataset to read (load_dataset's "
                                                           "`data_files`; glob patterns work)")
    format: str = opt("auto", "row layout: auto (whichever of prompt / messages / conversations / instruction a "
                              "row has), prompt (+ completion), messages (OpenAI roles), sharegpt (conversations "
                              "of from/value), alpaca (instruction + input, output as the answer)", choices=FORMATS)
    columns: dict[str, str] = opt(default_factory=dict, help="where the dataset keeps each field, e.g. {prompt: "
                                                             "question} or {instruction: task, input: context}")
    shuffle: bool = opt(False, "shuffle the rows (seeded) before sample / limit take theirs: a random sample")
    seed: int = opt(0, "shuffle seed")
    sample: int | None = opt(None, "use N usable rows of this source (after the shuffle, if any)")
    weight: float = opt(1.0, "this source's share of a mix (weights are relative)")
    streaming: bool = opt(False, "read a Hub dataset as a stream instead of downloading it whole (a shuffle then "
                                 "draws from a 10,000-row buffer)")

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise ConfigError("a prompt source needs a path (a file, a folder, a Hub dataset name or chat:train, ...) "
                              f"or a preset ({', '.join(PRESETS)})")
        if self.sample is not None and self.sample < 1:
            raise ConfigError(f"'sample' must be >= 1, got {self.sample}")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise ConfigError(f"'weight' must be a finite number > 0, got {self.weight}")
        for field, column in self.columns.items():
            if field not in FIELDS:
                raise ConfigError(f"'columns' maps unknown field '{field}'; fields: {', '.join(FIELDS)}")
            if not isinstance(column, str) or not column:
                raise ConfigError(f"'columns.{field}' must name a column, got {column!r}")
        if self.format != "auto":
            foreign = [f for f in self.columns if f != "id" and f not in FORMAT_FIELDS[self.format]]
            if foreign:
                raise ConfigError(f"'columns' maps {', '.join(foreign)}, which format {self.format} does not read "
                                  f"(it reads {', '.join(FORMAT_FIELDS[self.format])})")
        if self.builtin and (self.config or self.data_files or self.columns or self.format != "auto"
                             or self.streaming):
            raise ConfigError(f"{self.path} is a built-in source: config, data_files, columns, format and streaming "
                              "do not apply to it")

    @property
    def builtin(self) -> bool:
        return self.path.startswith(BUILTIN_PREFIXES)

    @property
    def hub(self) -> bool:
        """Read through ``datasets.load_dataset`` (a Hub name or loader; a local folder with files or a config)."""
        if self.builtin:
            return False
        p = Path(self.path).expanduser()
        return not p.exists() or (p.is_dir() and bool(self.config or self.data_files))

    def label(self) -> str:
        """``path[:config][@split]``: how rows and bad rows of this source are named."""
        return self.path + (f":{self.config}" if self.config else "") + (f"@{self.split}" if self.split else "")


def parse_sources(value: Any) -> list[SourceSpec]:
    """A source as written (string, mapping, list of either, or specs) -> its specs, checked.
    Raises ``ConfigError`` naming the fault and, for an unknown key, the valid ones."""
    if isinstance(value, SourceSpec):
        return [value]
    if isinstance(value, str) and value.lstrip().startswith(("{", "[")):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse the prompt source {value!r}: {' '.join(str(e).split())}") from None
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ConfigError("an empty list of prompt sources; give at least one")
    return [_spec(item, len(items) > 1) for item in items]


def _spec(item: Any, in_mix: bool) -> SourceSpec:
    if isinstance(item, SourceSpec):
        return item
    if isinstance(item, str):
        item = _from_string(item)
    if not isinstance(item, dict):
        raise ConfigError(f"a prompt source is a string or a mapping of source keys, got {item!r}")
    if item.get("preset") is not None:
        if item["preset"] not in PRESETS:
            raise ConfigError(f"unknown source preset '{item['preset']}'; presets: {', '.join(PRESETS)}")
        item = {**PRESETS[item["preset"]], **item}
    if not in_mix and "weight" in item:
        raise ConfigError("'weight' is a source's share of a mix: give a list of two or more sources")
    return from_dict(SourceSpec, item, prefix="source.")


def _from_string(text: str) -> dict[str, Any]:
    """One string source: a built-in or an existing path as it is (every form read before specs
    existed keeps its meaning), ``preset:NAME``, or ``NAME[:CONFIG][@SPLIT]``."""
    text = text.strip()
    if text.startswith("preset:"):
        return {"preset": text.removeprefix("preset:")}
    if text.startswith(BUILTIN_PREFIXES) or Path(text).expanduser().exists() or text.endswith(FILE_SUFFIXES):
        return {"path": text}
    m = _HUB.fullmatch(text)
    if m is None:
        return {"path": text}
    return {k: v for k, v in m.groupdict().items() if v is not None}
