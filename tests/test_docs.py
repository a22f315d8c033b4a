"""The READMEs only point at files that exist, and link the design and interop documents."""

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "benchmarks/README.md", "docs/smollm2.md", "docs/data.md"]
# a repository path: docs/..., configs/..., benchmarks/..., tests/..., headway/..., .ci/...
_PATH = re.compile(r"(?<![\w./-])((?:docs|configs|benchmarks|tests|headway|\.ci)/[\w./{},-]*)")
# a script or document named in backticks, relative to the document's folder (`run_demo_bench.sh [RUN_DIR]`)
_SCRIPT = re.compile(r"`([\w./-]+\.(?:sh|py|md|yaml|jinja))\b[^`]*`")


def expand(path: str) -> list[str]:
    """``a/{b,c}.{txt,json}`` -> the four paths."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def referenced(doc: str) -> list[tuple[int, str]]:
    """(line, path) for every repository path the document names. A path after "->" is what a
    command writes (``run_demo_bench.sh  # -> benchmarks/results/demo-bench.json``): not a reference."""
    out = []
    for n, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
        for m in _PATH.finditer(line):
            if line[:m.start()].rstrip().endswith("->"):
                continue
            out += [(n, p.rstrip(".,:;")) for p in expand(m.group(1))]
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_readme_names_exists(doc):
    found = referenced(doc)
    assert found, f"{doc}: no repository paths found; is the pattern still right?"
    missing = [f"{doc}:{n}: {p}" for n, p in found if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS)
def test_every_script_a_readme_names_exists(doc):
    here = (ROOT / doc).parent
    names = _SCRIPT.findall((ROOT / doc).read_text(encoding="utf-8"))
    missing = [n for n in names if not (here / n).exists() and not (ROOT / n).exists()]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_readme_links_the_design_and_interop_documents():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in ("docs/design.md", "docs/interop.md"):
        assert f"]({doc})" in readme, f"README.md does not link {doc}"
