"""The rooms and arrows of /work/shared/architecture.md, checked on the source: no import cycles
(lazy imports inside functions count too), no room importing the CLI, and one owner per contract."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "headway"
CLI = {"headway.cli", "headway.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or (
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every headway module ``path`` imports, at the top or inside a function (``if TYPE_CHECKING``
    blocks excluded: they never run). ``from pkg import name`` counts as importing ``pkg.name``
    when that is a module, else ``pkg``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("headway"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("headway"):
                    continue
                for a in child.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def test_the_walker_finds_imports():
    graph = import_graph()
    assert "headway.config" in graph["headway.target"]
    assert "headway.heads.base" in graph["headway.heads.medusa"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_no_module_below_the_cli_imports_it():
    offenders = {m: sorted(deps & CLI) for m, deps in import_graph().items() if m not in CLI and deps & CLI}
    assert offenders == {}


def test_nothing_outside_heads_opens_a_heads_config_json():
    """The checkpoint format has one owner: heads/ (read_config, read_metadata, update_metadata)."""
    opens = re.compile(r"""["']config\.json["']\s*\)?\s*\.?\s*(read_text|write_text|open)|open\([^)]*config\.json""")
    offenders = [str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
                 if "heads" not in f.relative_to(PACKAGE).parts[:1] and opens.search(f.read_text())]
    assert offenders == []


def test_every_command_that_runs_a_target_takes_the_same_target_options():
    import dataclasses

    from headway.cli import COMMANDS, _load
    from headway.target import TargetArgs

    shared = {f.name: f.metadata["choices"] for f in dataclasses.fields(TargetArgs)}
    for name in ("distill", "features", "train", "generate", "chat", "tune", "bench"):
        cls = _load(COMMANDS[name].config)
        assert issubclass(cls, TargetArgs), name
        assert {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if f.name in shared} == shared, name


def test_builtin_target_names_have_builders():
    from headway.demo.configs import PRESETS
    from headway.demo.named import NAMED_TARGETS as BUILT
    from headway.target import BUILDERS, DEMO_PRESETS, NAMED_TARGETS

    assert {"demo", *NAMED_TARGETS} == set(BUILDERS)
    assert BUILT is NAMED_TARGETS  # one table, in target.py, which the heads room (cards) may read
    assert set(DEMO_PRESETS) == set(PRESETS)


def test_rooms_import_only_downward():
    """The arrows of architecture.md that the code keeps: heads, decode and train never import the
    demo or bench rooms, nor the train room the decoder, nor data the heads."""
    below = {"headway.heads": ("headway.demo", "headway.bench", "headway.train", "headway.decode"),
             "headway.data": ("headway.demo", "headway.bench", "headway.train", "headway.decode", "headway.heads"),
             "headway.decode": ("headway.demo", "headway.bench", "headway.train"),
             "headway.train": ("headway.demo", "headway.bench", "headway.decode"),
             "headway.target": ("headway.demo", "headway.bench", "headway.train", "headway.decode", "headway.heads",
                                "headway.data")}
    offenders = {m: sorted(d for d in deps if d.startswith(never)) for m, deps in import_graph().items()
                 for room, never in below.items() if (m == room or m.startswith(room + ".")) and
                 any(d.startswith(never) for d in deps)}
    assert offenders == {}


def test_choices_are_enforced_by_the_config_parser():
    from headway.config import ConfigError, load_config
    from headway.data.configs import DistillConfig

    with pytest.raises(ConfigError, match="'dtype' must be one of float32, bfloat16, float16"):
        load_config(DistillConfig, None, {"source": "x.jsonl", "target": "t", "dtype": "float64"})
    assert load_config(DistillConfig, None, {"source": "x.jsonl", "target": "t", "dtype": "bfloat16"}).dtype == "bfloat16"


def test_every_head_kind_has_its_training_task():
    """``TASKS`` is one explicit table: every kind the train config accepts, and every heads kind
    the checkpoint format knows, has a task, and each task says which kind it is."""
    from headway.heads.load import HEAD_CLASSES
    from headway.train.config import KINDS
    from headway.train.registry import TASKS

    assert set(TASKS) == set(KINDS)
    assert set(HEAD_CLASSES) <= set(TASKS)
    assert all(task.kind == kind for kind, task in TASKS.items())


def test_only_publish_renames_a_temp_into_place():
    """One atomic-publish helper (headway/publish.py): no other module renames or moves files into
    place itself. A line that truly must carries an ``# atomic-publish: <why>`` comment."""
    # Path.replace takes one argument; str.replace and dataclasses.replace take more
    renames = re.compile(r"os\.replace\(|os\.rename\(|shutil\.move\(|\.rename\(|\.replace\([^)\"',]*\)")
    offenders = [f"{f.relative_to(PACKAGE)}:{i}" for f in PACKAGE.rglob("*.py") if f.name != "publish.py"
                 for i, line in enumerate(f.read_text().splitlines(), 1)
                 if renames.search(line.split("#")[0]) and "# atomic-publish:" not in line]
    assert offenders == []


def test_one_resolver_fetches_from_the_hub():
    """``target.resolve_folder`` alone turns a Hub repo id into a folder (heads, import, target)."""
    fetches = re.compile(r"snapshot_download|hf_hub_download")
    offenders = [str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
                 if f.name != "target.py" and fetches.search(f.read_text())]
    assert offenders == []
