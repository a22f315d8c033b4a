"""Plain dataclass configs: loaded from YAML, overridden from the command line.

Every CLI subcommand and every training recipe is one dataclass. Fields carry their help
text in ``field(metadata={"help": ...})``; nested dataclasses are addressed with dotted keys
(``optim.lr=1e-3``). Unknown keys are errors that name the key and the valid ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

from .errors import HeadwayError

T = TypeVar("T")


class ConfigError(HeadwayError, ValueError):
    """A config or command-line problem the user can fix; the message says how."""


def opt(default: Any = dataclasses.MISSING, help: str = "", *, positional: bool = False,
        choices: Sequence[Any] | None = None, default_factory: Any = dataclasses.MISSING,
        none_word: bool = False, kw_only: bool = False) -> Any:
    """``dataclasses.field`` with help text (and CLI hints) in its metadata. ``none_word``: the
    string "none" reaches the dataclass as "none" instead of meaning unset (``bench --assistant none``).
    ``choices`` are enforced by ``from_dict``. ``kw_only``: for a field a subclass re-declares from a
    keyword-only base (``TargetArgs.target`` with another default)."""
    meta = {"help": help, "positional": positional, "choices": tuple(choices) if choices else None,
            "none_word": none_word}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta, kw_only=kw_only or dataclasses.MISSING)
    return dataclasses.field(default=default, metadata=meta, kw_only=kw_only or dataclasses.MISSING)


@dataclasses.dataclass(kw_only=True)
class SamplingOptions:
    """How a command samples the target: temperature, top-p and top-k (applied in HF ``generate``'s
    order, ``headway/sampling.py``) and the seed of its draws. Declared once here, for every command
    that samples (distill, prompts, generate, chat), so their flags, YAML keys and help agree; a
    command whose default differs (prompts samples at 1.0, generate leaves the seed unset)
    re-declares that one field. Keyword-only, like ``TargetArgs``, so a config may mix both with
    required fields of its own."""

    temperature: float = opt(0.0, "sampling temperature; 0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling threshold (1 = off)")
    top_k: int = opt(0, "top-k sampling (0 = off)")
    seed: int = opt(0, "seed of the sampling draws: the same seed, settings and prompts draw the same output")

    def sampling_kwargs(self) -> dict[str, Any]:
        """``temperature``, ``top_p`` and ``top_k``, as the decoder and the data stage take them."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def valid_keys(cls: type, prefix: str = "") -> list[str]:
    """All dotted keys a dataclass accepts, nested ones included."""
    keys = []
    hints = _hints(cls)
    for name in _fields(cls):
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            keys += valid_keys(tp, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _unknown(key: str, cls: type, prefix: str = "") -> ConfigError:
    valid = valid_keys(cls, prefix)
    close = difflib.get_close_matches(prefix + key, valid, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown key '{prefix}{key}'.{hint} Valid keys: {', '.join(valid)}")


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML, or a CLI string) to the annotated type ``tp``."""
    tp, optional = _strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional or tp is Any:
            return None
        raise ConfigError(f"'{key}' may not be empty")
    if isinstance(value, str) and tp is Any:  # the field's own parser reads its strings (a prompt source)
        return value
    if isinstance(value, str) and tp is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            if not (_is_list(tp) and typing.get_args(tp)[:1] == (str,)):
                raise ConfigError(f"'{key}': cannot parse {value!r}: {' '.join(str(e).split())}") from None
            # a list of strings given one string that is no YAML ('*.jsonl': a glob, not an alias): that string
    origin = typing.get_origin(tp)
    try:
        if tp is Any:
            return value
        if tp is bool:
            if isinstance(value, bool):
                return value
            raise ConfigError(f"'{key}' must be true or false, got {value!r}")
        if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (an exponent without a dot) as text
            with contextlib.suppress(ValueError):  # not a number at all: refused just below, by name
                value = float(value)
        if tp in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"'{key}' must be a number, got {value!r}")
            if tp is int and float(value) != int(value):
                raise ConfigError(f"'{key}' must be an integer, got {value!r}")
            return tp(value)
        if tp is str:
            return str(value)
        if origin in (list, tuple):
            (item_tp, *_) = typing.get_args(tp) or (Any,)
            items = value if isinstance(value, (list, tuple)) else [value]
            out = [coerce(v, item_tp, key) for v in items]
            return out if origin is list else tuple(out)
        if origin is dict or tp is dict:
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
            return dict(value)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"'{key}' must be a mapping, got {value!r}")
            return from_dict(tp, value, prefix=key + ".")
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"'{key}': {e}") from None
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build ``cls`` from a (nested) dict, refusing unknown keys."""
    fields, hints = _fields(cls), _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown(key, cls, prefix)
        if fields[key].metadata.get("none_word") and isinstance(value, str) and value.strip().lower() == "none":
            kwargs[key] = "none"
            continue
        kwargs[key] = coerce(value, hints[key], prefix + key)
        check_choices(fields[key], kwargs[key], prefix + key)
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required key(s): {', '.join(prefix + m for m in missing)}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"'{dotted}': '{p}' is not a section")
    tree[leaf] = value


def _field_type(cls: type, dotted: str) -> Any:
    tp: Any = cls
    for i, part in enumerate(dotted.split(".")):
        if not dataclasses.is_dataclass(tp) or part not in _fields(tp):
            raise _unknown(part, tp if dataclasses.is_dataclass(tp) else cls, ".".join(dotted.split(".")[:i]) + ("." if i else ""))
        tp = _hints(tp)[part]
    return tp


def _is_list(tp: Any) -> bool:
    return typing.get_origin(_strip_optional(tp)[0]) in (list, tuple)


def key_name(option: str) -> str:
    """``num-prompts`` / ``eagle.draft-vocab-size`` -> the field's key: on the command line dashes
    and underscores are the same character (``--num-prompts`` = ``--num_prompts`` = ``num_prompts=``)."""
    return option.replace("-", "_")


def flag_name(key: str) -> str:
    """The spelling ``--help`` shows and the README uses: dashes (``num_prompts`` -> ``num-prompts``)."""
    return key.replace("_", "-")


def parse_args(cls: type, argv: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """Split argv into (yaml path, {dotted key: raw value}).

    Accepts ``--config X``, ``key=value``, ``--key value``, ``--key=value``, ``--flag`` /
    ``--no-flag`` for booleans, several values after a list option, and positional fields.
    """
    positional = [n for n, f in _fields(cls).items() if f.metadata.get("positional")]
    config_path, out = None, {}
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--config", "-c"):
            if i + 1 >= len(args):
                raise ConfigError("--config needs a YAML path")
            config_path, i = args[i + 1], i + 2
            continue
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            key = key_name(key)
            negated = False
            if not eq and key.startswith("no_"):
                try:
                    negated = _strip_optional(_field_type(cls, key[3:]))[0] is bool
                except ConfigError:
                    negated = False
            if negated:
                out[key[3:]], i = False, i + 1
                continue
            tp = _field_type(cls, key)
            if eq:
                out[key], i = val, i + 1
            elif _strip_optional(tp)[0] is bool and (i + 1 >= len(args) or args[i + 1].startswith("--")
                                                     or args[i + 1].lower() not in ("true", "false")):
                out[key], i = True, i + 1
            elif _is_list(tp):
                vals = []
                i += 1
                while i < len(args) and not args[i].startswith("--") and "=" not in args[i]:
                    vals.append(args[i])
                    i += 1
                if not vals:
                    raise ConfigError(f"--{key} needs at least one value")
                out[key] = [yaml.safe_load(v) if not isinstance(v, str) else v for v in vals]
            else:
                if i + 1 >= len(args):
                    raise ConfigError(f"--{key} needs a value")
                out[key], i = args[i + 1], i + 2
            continue
        name = a.split("=", 1)[0]
        if "=" in a and not a.startswith("-") and name.replace(".", "").replace("_", "").replace("-", "").isalnum():
            key, _, val = a.partition("=")
            key = key_name(key)
            _field_type(cls, key)  # validates
            out[key], i = val, i + 1
            continue
        if a.startswith("-"):
            raise ConfigError(f"unknown option '{a}'. Valid options: "
                              + ", ".join("--" + flag_name(k) for k in valid_keys(cls)))
        if not positional:
            raise ConfigError(f"unexpected argument '{a}'. Options look like --key value or key=value")
        name = positional[0]
        if _is_list(_field_type(cls, name)):  # a positional list takes every remaining positional argument
            out.setdefault(name, []).append(a)
        else:
            out[positional.pop(0)] = a
        i += 1
    return config_path, out


def _json_kind(value: Any) -> str:
    names = {dict: "mapping", list: "list", str: "string", bool: "boolean", int: "number", float: "number",
             type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_utf8(path: Path, error: type[HeadwayError] = ConfigError) -> str:
    """A text file's contents; unreadable or non-UTF-8 bytes are ``error`` naming the file, line and byte."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(f"{path}: not UTF-8 (byte 0x{raw[e.start]:02x} at line {line}, column {col})") from None


def read_json_object(path: Path, error: type[HeadwayError] = ConfigError) -> dict[str, Any]:
    """A JSON file that must hold one object (a ``config.json``); anything else is one ``error``
    line naming the file and what is wrong with it, never a raw decoder traceback."""
    text = read_utf8(path, error)
    if not text.strip():
        raise error(f"{path}: the file is empty; expected a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise error(f"{path}: invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object {{...}} at the top level, got a JSON {_json_kind(data)}")
    return data


def read_config_file(path: Path) -> dict[str, Any]:
    """A YAML (or ``.json``) config file as a mapping; any fault is one ``ConfigError`` line."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.suffix.lower() == ".json":
        return read_json_object(path)
    text = read_utf8(path)
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:  # its str() spans several lines; keep the position and the problem
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{path}: invalid YAML{at}: {what}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got a {_json_kind(loaded)}")
    return loaded


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] | dict[str, Any] = ()) -> T:
    """YAML file (optional) + overrides (CLI strings or a dotted dict) -> validated dataclass."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_config_file(Path(path))
    if not isinstance(overrides, dict):
        overrides = parse_args(cls, overrides)[1]
    for key, value in overrides.items():
        _field_type(cls, key)
        _set_dotted(data, key, value)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{e}") from None


def parse_cli(cls: type[T], argv: Sequence[str]) -> T:
    path, overrides = parse_args(cls, argv)
    return load_config(cls, path, overrides)


def help_text(cls: type, prog: str, summary: str = "") -> str:
    """A --help page generated from the dataclass fields."""
    lines = [f"usage: {prog} [--config FILE.yaml] [--key value | key=value ...]", ""]
    if summary:
        lines += [summary, ""]
    hints = _hints(cls)

    def walk(c: type, prefix: str) -> None:
        for name, f in _fields(c).items():
            tp = hints_of(c)[name]
            if dataclasses.is_dataclass(tp):
                walk(tp, prefix + name + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
            choices = f.metadata.get("choices")
            extra = f" {{{', '.join(map(str, choices))}}}" if choices else ""
            flag = prefix + name if f.metadata.get("positional") and not prefix else "--" + flag_name(prefix + name)
            lines.append(f"  {flag:<28} {f.metadata.get('help', '')}{extra} [default: {default}]")

    def hints_of(c: type) -> dict[str, Any]:
        return hints if c is cls else _hints(c)

    walk(cls, "")
    lines += ["", "Options take --key value, --key=value or key=value (dotted keys for nested sections);",
              "dashes and underscores are the same (--num-prompts = --num_prompts = num_prompts=...);",
              "booleans: --flag / --no-flag; list options take several values (--temperature 0 1).",
              "Command-line values override the --config file."]
    return "\n".join(lines)


def check_choices(f: dataclasses.Field, value: Any, key: str) -> None:
    """``opt(choices=...)`` is a rule, not a hint: a value (or, for a list, each item) outside the
    choices is a ``ConfigError``. None passes: it means unset."""
    choices = f.metadata.get("choices")
    if not choices or value is None:
        return
    for item in value if isinstance(value, (list, tuple)) else [value]:
        check_choice(item, choices, key)


def check_choice(value: Any, choices: Sequence[Any], key: str) -> None:
    if value not in choices:
        raise ConfigError(f"'{key}' must be one of {', '.join(map(str, choices))}; got {value!r}")


# rule text -> test; a value of None (an unset optional) passes every rule
RULES: dict[str, Any] = {
    "> 0": lambda x: x > 0, ">= 0": lambda x: x >= 0, ">= 1": lambda x: x >= 1, ">= 2": lambda x: x >= 2,
    "in [0, 1)": lambda x: 0 <= x < 1, "in [0, 1]": lambda x: 0 <= x <= 1, "in (0, 1]": lambda x: 0 < x <= 1,
}


def check_numbers(section: Any, prefix: str, rules: dict[str, str]) -> None:
    """Refuse NaN, infinity and out-of-range numbers at config load, naming the key and its rule
    (a NaN lr would otherwise train silently to NaN heads). List values are checked item by item."""
    import math

    for name, rule in rules.items():
        value = getattr(section, name)
        for x in value if isinstance(value, (list, tuple)) else [value]:
            if x is not None and (isinstance(x, bool) or not math.isfinite(x) or not RULES[rule](x)):
                what = "a finite number " if isinstance(x, float) else ""
                raise ConfigError(f"'{prefix}{name}' must be {what}{rule}, got {value!r}")
