"""The rooms and arrows of docs/design.md §2, checked on the source: every import follows the
"may import" table, no import cycles (lazy imports inside functions, ``if TYPE_CHECKING:`` imports
and module names handed to ``importlib`` count too), no room importing the CLI, and one owner per
contract."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "headway"
CLI = {"headway.cli", "headway.__main__"}

# The table of docs/design.md §2 ("Who may import whom"): room -> the rooms it may import. Every room may also import
# itself, the ground floor and the kernels; the CLI may import everything.
MAY_IMPORT: dict[str, set[str]] = {
    "ground": set(),
    "kernels": set(),
    "config": set(),
    "target": {"config"},
    "data": {"config", "target", "engines"},
    "heads": {"config", "target"},
    "train": {"config", "target", "data", "heads"},
    "decode": {"config", "target", "heads"},
    "bench": {"config", "target", "data", "heads", "train", "decode", "engines"},
    "engines": {"config", "target"},
    "adapt": {"config", "target", "data", "heads", "train", "decode"},
    "demo": {"config", "target", "data", "heads", "train", "decode", "bench", "engines", "adapt"},
    "cli": {"config", "target", "data", "heads", "train", "decode", "bench", "engines", "adapt", "demo"},
}
FOR_EVERY_ROOM = {"ground", "kernels"}
# One module with one more room than the rest of its room (docs/design.md §2 says why): the
# generate / chat commands format a prompt exactly as distill does, with data's plans.
MODULE_MAY_IMPORT = {"headway.decode.cli": {"data"}}
# Module -> room. Single-module rooms and the ground floor by name; packages by their folder.
MODULE_ROOMS = {
    "headway.config": "config", "headway.target": "target", "headway.kernels": "kernels",
    "headway.native": "kernels", "headway.cli": "cli", "headway.__main__": "cli",
    **{f"headway.{m}": "ground" for m in ("__init__", "publish", "locking", "progress", "errors", "compat", "hardware",
                                          "lazy", "sampling", "tokenizer", "optional", "feature_layers", "testing")},
}
MODULE_ROOMS["headway"] = MODULE_ROOMS.pop("headway.__init__")
PACKAGE_ROOMS = ("data", "heads", "train", "decode", "bench", "demo", "engines", "adapt")
# a string constant naming a headway module: what importlib, __import__ or a lazy table is handed
MODULE_NAME = re.compile(r"(headway(?:\.\w+)+)(?::\w+(?:\.\w+)*)?")


def room_of(module: str) -> str | None:
    """The room ``module`` lives in (None: a module the table does not place)."""
    if module in MODULE_ROOMS:
        return MODULE_ROOMS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGE_ROOMS else None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(base: str, level: int, package: str) -> str:
    """The absolute name of ``from <level dots><base> import ...`` written in ``package``."""
    if not level:
        return base
    anchor = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(anchor + ([base] if base else []))


def _dict_values(tree: ast.AST, name: str) -> list[str]:
    """The string values of every ``name = {...}`` dict literal in ``tree``."""
    return [v.value for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
            and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
            for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def imports_of(source: str, name: str, modules: set[str], is_package: bool = False) -> set[str]:
    """Every headway module the module ``name`` (source ``source``) imports: at the top, inside a
    function, under ``if TYPE_CHECKING:`` (an arrow all the same: the code is written against it),
    or by name: a string constant naming a module (``"headway.demo.builder:build"``, handed to
    ``importlib.import_module`` or ``__import__``), ``importlib.import_module(".x", package)``, and
    the submodules of a ``lazy_exports`` table. ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, package)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.fullmatch(node.value):
            found.add(MODULE_NAME.fullmatch(node.value).group(1))
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            args = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
            if func == "import_module" and args and args[0] and args[0].startswith("."):
                anchor = args[1] if len(args) > 1 and args[1] else package
                found.add(_resolve(args[0].lstrip("."), len(args[0]) - len(args[0].lstrip(".")), anchor))
            elif func == "lazy_exports" and len(node.args) > 1 and isinstance(node.args[1], ast.Name):
                found.update(f"{name if is_package else package}.{sub}" for sub in _dict_values(tree, node.args[1].id))
    return {m for m in found if m in modules and m != name}


def _imports(path: Path, modules: set[str]) -> set[str]:
    return imports_of(path.read_text(), _module_name(path), modules, path.name == "__init__.py")


@functools.cache  # read once per session: the callers never change it
def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every ``module -> imported`` arrow the table forbids, each with the rule it breaks."""
    out = []
    for module, deps in sorted(graph.items()):
        room = room_of(module)
        allowed = MAY_IMPORT[room] | FOR_EVERY_ROOM | {room} | MODULE_MAY_IMPORT.get(module, set())
        for dep in sorted(deps):
            if room_of(dep) not in allowed:
                may = ", ".join(sorted(MAY_IMPORT[room])) or "nothing"
                out.append(f"{module} -> {dep}: the {room} room may import {may} (and the ground floor, "
                           f"the kernels), not {room_of(dep)}")
    return out


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


def test_the_design_doc_states_this_table():
    """docs/design.md §2 and MAY_IMPORT are one statement's two halves: the same rooms, the same arrows."""
    text = (PACKAGE.parent / "docs" / "design.md").read_text(encoding="utf-8")
    section = text.split("### Who may import whom", 1)[1].split("\n\n")
    rows = [line for block in section if block.startswith("| room |") for line in block.splitlines()[2:]]
    cell_room = {"ground floor": "ground", "kernels": "kernels", "`config.py`": "config", "`target.py`": "target",
                 "`cli.py`": "cli", **{f"`{r}/`": r for r in PACKAGE_ROOMS}}
    stated = {}
    for row in rows:
        first, arrows = (c.strip() for c in row.strip("|").split("|"))
        room = next(r for cell, r in cell_room.items() if first.startswith(cell))
        arrows = re.sub(r"\(.*?\)", "", arrows)
        if arrows.startswith("everything"):
            stated[room] = set(MAY_IMPORT) - {room, "ground", "kernels", "cli"} - (
                {"demo"} if "above" in arrows else set())
        else:
            stated[room] = {a.strip() for a in arrows.split(",")} - {"nothing of headway but the ground floor",
                                                                     "the ground floor"}
    assert stated == MAY_IMPORT
    assert "`decode/cli.py` also data" in text and MODULE_MAY_IMPORT == {"headway.decode.cli": {"data"}}


def test_every_module_has_a_room():
    """A new module is placed in the table (MODULE_ROOMS / PACKAGE_ROOMS) before it imports anything."""
    assert [m for m in import_graph() if room_of(m) is None] == []


def test_every_arrow_follows_the_table():
    """Each (module -> imported module) pair the "may import" table forbids, with the rule it breaks."""
    assert room_violations(import_graph()) == []


SYNTHETIC = """
from typing import TYPE_CHECKING
import importlib
if TYPE_CHECKING:
    from .demo.pipeline import DemoConfig
BUILD = "headway.bench.run:bench"
def f():
    return importlib.import_module(".train.recipe", "headway"), __import__("headway.decode.tree")
"""


def test_the_checker_counts_type_checking_and_importlib_names():
    modules = {"headway.target", "headway.demo.pipeline", "headway.bench.run", "headway.train.recipe",
               "headway.decode.tree", "headway.demo"}
    found = imports_of(SYNTHETIC, "headway.target", modules)
    assert found == {"headway.demo.pipeline", "headway.bench.run", "headway.train.recipe", "headway.decode.tree"}
    broken = room_violations({"headway.target": found})
    assert len(broken) == 4 and all(b.startswith("headway.target -> ") for b in broken)
    assert "headway.target -> headway.demo.pipeline: the target room may import config" in broken[2]
    assert room_violations({"headway.demo.pipeline": {"headway.target", "headway.bench.run"}}) == []


def test_the_checker_reads_lazy_export_tables():
    source = 'from ..lazy import lazy_exports\n_EXPORTS = {"Speculator": "speculator"}\n' \
             '__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())\n'
    found = imports_of(source, "headway.decode", {"headway.decode", "headway.decode.speculator", "headway.lazy"},
                       is_package=True)
    assert found == {"headway.decode.speculator", "headway.lazy"}


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


def test_only_heads_and_target_look_for_a_checkpoints_files():
    """Whether a folder holds saved heads (``heads.files.is_heads_checkpoint``) or a saved model
    (``target.is_target_folder``) is asked of its owner; no other room joins those file names."""
    joins = re.compile(r"""/\s*["'](config\.json|model\.safetensors)["']\s*\)?\s*\.(is_file|exists|stat|open|read)""")
    offenders = [f"{f.relative_to(PACKAGE)}:{i}" for f in PACKAGE.rglob("*.py")
                 if f.relative_to(PACKAGE).parts[0] not in ("heads", "target.py")
                 for i, line in enumerate(f.read_text().splitlines(), 1) if joins.search(line.split("#")[0])]
    assert offenders == []


def test_only_the_target_room_loads_a_tokenizer():
    """``target.load_tokenizer`` (one-line errors, ``trust_remote_code`` as the target's). The demo
    room's GGUF conversion reads the tokenizer out of the GGUF it builds the target from."""
    loads = re.compile(r"AutoTokenizer\.from_pretrained\(")
    builds = {"demo/named.py"}
    offenders = [str(f.relative_to(PACKAGE)) for f in PACKAGE.rglob("*.py")
                 if f.relative_to(PACKAGE).as_posix() not in {"target.py", *builds} and loads.search(f.read_text())]
    assert offenders == []


def test_every_command_that_runs_a_target_takes_the_same_target_options():
    import dataclasses

    from headway.cli import COMMANDS, _load
    from headway.target import TargetArgs

    shared = {f.name: f.metadata["choices"] for f in dataclasses.fields(TargetArgs)}
    for name in ("distill", "features", "train", "generate", "chat", "tune", "bench", "eval"):
        cls = _load(COMMANDS[name].config)
        assert issubclass(cls, TargetArgs), name
        assert {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if f.name in shared} == shared, name


def test_builtin_target_names_have_builders():
    """target.py names the built-in targets; the demo room builds them, declared as entry points
    (pyproject.toml) so that the target room never names the room above it."""
    from importlib.metadata import entry_points

    from headway.demo.configs import PRESETS
    from headway.demo.named import NAMED_TARGETS as BUILT
    from headway.target import ASSISTANT_GROUP, BUILDER_GROUP, BUILDERS, DEMO_PRESETS, NAMED_TARGETS, entry_point

    assert set(BUILDERS) == {"demo", *NAMED_TARGETS}
    assert {e.name for e in entry_points(group=BUILDER_GROUP)} == set(BUILDERS)
    assert {e.name for e in entry_points(group=ASSISTANT_GROUP)} == {"demo"}
    for group in (BUILDER_GROUP, ASSISTANT_GROUP):
        for e in entry_points(group=group):
            assert room_of(e.module) == "demo" and callable(entry_point(group, e.name)), e
    assert BUILT is NAMED_TARGETS  # one table, in target.py, which the heads room (cards) may read
    assert set(DEMO_PRESETS) == set(PRESETS)


def test_an_unregistered_builder_is_one_clear_error():
    from headway.target import BUILDER_GROUP, TargetError, entry_point

    with pytest.raises(TargetError, match="no 'nope' in the entry points 'headway.targets'.*pip install -e"):
        entry_point(BUILDER_GROUP, "nope")


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


MAX_FILE_LINES = 600  # a file past this holds more than one concern (issue #64)
MAX_CONFIG_ENTRIES = 3  # functions per file that take a run's whole TrainConfig


def test_no_file_in_the_package_is_over_its_line_budget():
    long = {str(f.relative_to(PACKAGE)): n for f in PACKAGE.rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_a_training_config_enters_a_file_at_most_three_times():
    """A run's ``TrainConfig`` is handed to few functions per file: the recipe holds it and passes
    on the values the small modules need, so a module's inputs say what it reads."""
    import ast

    def entries(path) -> int:
        return sum(1 for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for a in [*node.args.args, *node.args.kwonlyargs]
                   if a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation))

    over = {str(f.relative_to(PACKAGE)): n for f in PACKAGE.rglob("*.py") if (n := entries(f)) > MAX_CONFIG_ENTRIES}
    assert over == {}
