"""The ``headway`` command itself: --version, command groups, --help that needs no torch, a reader
that closes the pipe early, and option spellings (dashes and underscores are the same)."""

import json
import os
import subprocess
import sys

import pytest

import headway
from headway.cli import COMMANDS, _load, main
from headway.config import help_text, parse_cli

# Their modules import torch for the work itself (generation, the feature store); moving their
# configs out is left to the files' owner (issue #16).
HEAVY_CONFIGS: set[str] = set()  # every --help is light now (distill and features: data/configs.py)


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headway", *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version_without_torch(flag):
    code = ("import sys; from headway.cli import main; rc = main([%r]); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)" % flag)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"headway {headway.__version__}", "[]"]


@pytest.mark.parametrize("world", ["1", "2"])
def test_a_rank_of_a_multi_process_run_skips_interpreter_teardown(world, tmp_path):
    """Under accelerate launch (WORLD_SIZE > 1) a finished rank leaves with os._exit: main's exit
    code and its flushed output, but no teardown (atexit handlers, the Gloo group's destructors)."""
    code = ("import atexit, sys; atexit.register(lambda: print('teardown')); sys.argv[1:] = %r; "
            "from headway.cli import entry; entry()")
    env = {**os.environ, "WORLD_SIZE": world}
    ok = subprocess.run([sys.executable, "-c", code % ["--version"]], capture_output=True, text=True, timeout=120,
                        env=env)
    teardown = ["teardown"] if world == "1" else []
    assert ok.returncode == 0 and ok.stdout.splitlines() == [f"headway {headway.__version__}", *teardown]
    bad = subprocess.run([sys.executable, "-c", code % ["merge", str(tmp_path / "a"), str(tmp_path / "b")]],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "merge input not found" in bad.stderr and bad.stdout.splitlines() == teardown


def test_version_matches_the_installed_metadata():
    from importlib.metadata import version

    assert version("headway") == headway.__version__


@pytest.mark.parametrize("argv", [["target"], ["target", "--help"], ["target", "-h"]])
def test_a_group_name_lists_its_commands(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "target build" in out and "unknown command" not in out
    assert COMMANDS["target build"].summary in out


def test_an_unknown_command_in_a_group_names_the_group(capsys):
    assert main(["target", "nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "headway: error: unknown command 'target nonsense'; 'target' commands: build"


@pytest.mark.parametrize("argv", [["bench", "--help"], ["--help"], ["target", "--help"]])
def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(argv):
    """``headway bench --help | head -1``: the read end is closed before headway writes."""
    proc = subprocess.Popen([sys.executable, "-m", "headway", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) in (0, 141)
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_a_pipe_through_head_is_quiet():
    out = subprocess.run(f"{sys.executable} -m headway bench --help | head -1", shell=True, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.startswith("usage: headway bench") and out.stderr == ""


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - HEAVY_CONFIGS))
def test_help_needs_neither_torch_nor_transformers(name):
    """What ``headway <command> --help`` imports: the config dataclass, and nothing heavy."""
    code = ("import json, sys, headway.cli; headway.cli._load(%r); "
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))" % COMMANDS[name].config)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [], f"{name}: loading {COMMANDS[name].config} imports {out.stdout.strip()}"


@pytest.mark.parametrize("old,new", [
    ("headway.demo.builder:TargetBuildConfig", "target build"),
    ("headway.heads.importers:ImportConfig", "import"),
    ("headway.heads.export:ExportConfig", "export"),
    ("headway.bench.tune:TuneConfig", "tune"),
    ("headway.bench.run:BenchConfig", "bench"),
    ("headway.data.distill:DistillConfig", "distill"),
    ("headway.data.features:FeaturesConfig", "features"),
])
def test_configs_stay_importable_from_their_old_modules(old, new):
    assert _load(old) is _load(COMMANDS[new].config)


def test_import_formats_are_the_importers():
    from headway.heads.configs import EXPORT_DTYPES, EXPORT_FORMATS, IMPORT_FORMATS
    from headway.heads.export import DTYPES, FORMATS
    from headway.heads.importers import IMPORTERS

    assert tuple(IMPORTERS) == IMPORT_FORMATS and FORMATS == EXPORT_FORMATS and tuple(DTYPES) == EXPORT_DTYPES


def test_dashes_and_underscores_are_the_same_in_every_spelling():
    from headway.bench.configs import BenchConfig
    from headway.train.config import TrainConfig

    for argv in (["--num-prompts", "3"], ["--num_prompts", "3"], ["--num-prompts=3"], ["num_prompts=3"],
                 ["num-prompts=3"]):
        assert parse_cli(BenchConfig, ["--target", "demo", *argv]).num_prompts == 3, argv
    assert parse_cli(BenchConfig, ["--target=demo", "--no-progress"]).progress is False
    assert parse_cli(BenchConfig, ["target=demo", "--no_progress"]).progress is False
    for argv in (["--optim.max-grad-norm", "0.5"], ["--optim.max_grad_norm", "0.5"], ["optim.max-grad-norm=0.5"]):
        assert parse_cli(TrainConfig, ["--target", "demo", *argv]).optim.max_grad_norm == 0.5, argv


def test_help_shows_the_dashed_spelling_the_readme_uses():
    from headway.bench.configs import BenchConfig

    text = help_text(BenchConfig, "headway bench")
    flags = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert "--num-prompts" in flags and "--max-new-tokens" in flags and not any("_" in f for f in flags)
    assert "dashes and" in text and "underscores are the same" in text
    guide = open("docs/training.md", encoding="utf-8").read()  # the README's pipeline section moved here
    assert "--num-prompts" in guide and "dashes and underscores are interchangeable" in guide
