"""The documentation builds: every file it names exists, every link and anchor resolves, and every
command the README shows exists with those flags. CI runs only `make test`, so this is the docs build."""

import itertools
import re
import shlex
from pathlib import Path

import pytest

from headway.cli import COMMANDS, _find, _load
from headway.config import parse_args

ROOT = Path(__file__).resolve().parent.parent
# the README, everything under docs/, and each top-level folder's README
DOCS = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")) + sorted(
    p.relative_to(ROOT).as_posix() for p in ROOT.glob("*/README.md") if not p.parts[-2].startswith((".", "headway")))
# documents whose backticked script names resolve against their folder or the root (design.md,
# interop.md, peagle.md and peers.md name package-relative modules and engines' and peers' files)
SCRIPT_DOCS = [d for d in DOCS if d not in ("docs/design.md", "docs/interop.md", "docs/peagle.md", "docs/peers.md",
                                             "configs/README.md")]
README_MAX_LINES = 250
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
    assert found or doc != "README.md", f"{doc}: no repository paths found; is the pattern still right?"
    missing = [f"{doc}:{n}: {p}" for n, p in found if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("doc", SCRIPT_DOCS)
def test_every_script_a_readme_names_exists(doc):
    here = (ROOT / doc).parent
    names = _SCRIPT.findall((ROOT / doc).read_text(encoding="utf-8"))
    missing = [n for n in names if not (here / n).exists() and not (ROOT / n).exists()]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_readme_links_the_design_and_interop_documents():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in ("docs/design.md", "docs/interop.md"):
        assert f"]({doc})" in readme, f"README.md does not link {doc}"


def test_the_readme_is_a_guide_not_a_log():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/ (limit {README_MAX_LINES})"


# ----------------------------------------------------------------------------- links and anchors
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link in a code sample is no link)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup and punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = prose(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(_ANCHOR.findall(text))
    for _, title in _HEADING.findall(text):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(doc: str) -> list[tuple[str, str]]:
    """(target path or "", anchor or "") for every relative link of a document."""
    out = []
    for target in _LINK.findall(prose((ROOT / doc).read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


def test_slug_follows_github():
    assert slug("Train EAGLE-3 for your model") == "train-eagle-3-for-your-model"
    assert slug("On a real pretrained target: SmolLM2-135M-Instruct (2 CPU cores)") == \
        "on-a-real-pretrained-target-smollm2-135m-instruct-2-cpu-cores"
    assert slug("`headway export` and [vLLM](https://x)") == "headway-export-and-vllm"


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_and_anchor_resolves(doc):
    here = (ROOT / doc).parent
    broken = []
    for path, anchor in links(doc):
        target = (here / path).resolve() if path else ROOT / doc
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif ROOT not in target.parents and target != ROOT:
            broken.append(f"{path}: outside the repository")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor}: no such heading or anchor in {target.relative_to(ROOT)}")
    assert not broken, f"{doc}:\n" + "\n".join(broken)


def test_a_broken_anchor_is_caught(tmp_path, monkeypatch):
    """The checker's control: a link to a heading that is not there must fail it."""
    (tmp_path / "a.md").write_text("# Title\n\n## Real section\n\n[ok](#real-section) [bad](#missing)\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="#missing: no such heading"):
        test_every_link_and_anchor_resolves("a.md")


# ----------------------------------------------------------------------------- README commands
def shell_lines(text: str) -> list[list[str]]:
    """The commands of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:  # a && b: two commands
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                out.append(tokens[:cut])
                tokens = tokens[cut + 1:]
    return out


def headway_argv(tokens: list[str]) -> list[str] | None:
    """What follows `headway` (or `-m headway`), else None."""
    if tokens[0] in ("headway", ".venv/bin/headway"):
        return tokens[1:]
    for i, t in enumerate(tokens):
        if t == "-m" and tokens[i + 1:i + 2] == ["headway"]:
            return tokens[i + 2:]
    return None


def check_headway(argv: list[str]) -> str | None:
    name, rest = _find(argv)
    if name is None:
        return f"unknown command: headway {' '.join(argv[:2])}"
    try:
        path, _ = parse_args(_load(COMMANDS[name].config), rest)
    except Exception as e:  # the CLI's own parser: an unknown option is a ConfigError naming it
        return f"headway {name}: {e}"
    if path and not (ROOT / path).is_file():
        return f"headway {name}: --config {path} does not exist"
    return None


def check_command(tokens: list[str]) -> str | None:
    if tokens[:2] == ["accelerate", "launch"] and "--config_file" in tokens:
        path = tokens[tokens.index("--config_file") + 1]
        if not (ROOT / path).is_file():
            return f"accelerate launch: --config_file {path} does not exist"
    argv = headway_argv(tokens)
    if argv is not None:
        return check_headway(argv)
    if tokens[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        missing = [t for t in tokens[1:] if "=" not in t and t not in targets]
        return f"make: no target {missing}" if missing else None
    scripts = [t for t in tokens if t.endswith((".py", ".sh")) and (ROOT / t).is_file()]
    if scripts:
        source = (ROOT / scripts[0]).read_text(encoding="utf-8")
        flags = [t.split("=")[0] for t in tokens[tokens.index(scripts[0]) + 1:] if t.startswith("--")]
        missing = [f for f in flags if f'"{f}"' not in source]
        return f"{scripts[0]}: no option {missing}" if missing else None
    return None


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    inline = [shlex.split(c.replace("\n", " ")) for c in re.findall(r"`(headway [^`]+)`", prose(text))]
    return shell_lines(text) + [c for c in inline if "<" not in " ".join(c)]  # `headway <command>`: a pattern


def test_every_readme_command_exists_with_its_flags():
    commands = readme_commands()
    assert any(c[:2] == ["headway", "export"] for c in commands) and any(c[:2] == ["make", "demo"] for c in commands)
    problems = [p for c in commands if (p := check_command(c))]
    assert not problems, "\n".join(problems)


def test_the_command_check_can_fail():
    assert check_command(["headway", "export", "H", "--format", "vllm", "--outt", "D"])
    assert check_command(["headway", "distill", "--config", "configs/nope.yaml"])
    assert check_command(["headway", "trian"])
    assert check_command(["make", "demoo"])
    assert check_command(["accelerate", "launch", "--config_file", "configs/fsdp.yaml", "-m", "headway", "train"])
    assert check_command(["python", "checks/vllm_parity.py", "--no-such-flag"])
    assert check_command(["headway", "export", "H", "--format", "vllm", "--out", "D"]) is None


def test_the_reference_lists_every_command():
    text = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    missing = [name for name in COMMANDS if f"`headway {name}`" not in text]
    assert not missing, f"docs/reference.md's command table lacks {missing}"
