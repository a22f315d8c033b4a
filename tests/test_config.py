from dataclasses import dataclass, field
from pathlib import Path

import pytest

from headway.config import ConfigError, load_config, opt, parse_cli
from headway.cli import main


@dataclass
class Optim:
    lr: float = opt(1e-3, "learning rate")
    betas: list[float] = opt(default_factory=lambda: [0.9, 0.95], help="Adam betas")


@dataclass
class Cfg:
    name: str = opt("x", "a name")
    steps: int = opt(10, "steps")
    flag: bool = opt(False, "a flag")
    temps: list[float] = opt(default_factory=lambda: [0.0], help="temperatures")
    maybe: int | None = opt(None, "optional")
    optim: Optim = field(default_factory=Optim)


def test_yaml_and_overrides(tmp_path: Path):
    p = tmp_path / "c.yaml"
    p.write_text("steps: 5\noptim:\n  lr: 0.5\n")
    cfg = load_config(Cfg, p, ["optim.lr=0.25", "--flag", "--temps", "0", "1", "--maybe=3", "name=y"])
    assert cfg.steps == 5 and cfg.optim.lr == 0.25 and cfg.flag is True
    assert cfg.temps == [0.0, 1.0] and cfg.maybe == 3 and cfg.name == "y"
    assert cfg.optim.betas == [0.9, 0.95]


def test_an_exponent_without_a_dot_is_a_number_in_yaml_and_on_the_command_line(tmp_path: Path):
    """YAML 1.1 (PyYAML) reads `1e-3` as a string: a float field takes it as the number it spells."""
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 1e-3\n")
    assert load_config(Cfg, p).optim.lr == 1e-3
    cfg = load_config(Cfg, None, ["optim.lr=2E-4", "--temps", "1e-1", "5e0"])
    assert cfg.optim.lr == 2e-4 and cfg.temps == [0.1, 5.0]
    with pytest.raises(ConfigError, match="'optim.lr' must be a number, got 'fast'"):
        load_config(Cfg, None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match="'steps' must be"):  # integers stay strict
        load_config(Cfg, None, ["steps=1e3"])


def test_no_flag_and_config_flag(tmp_path: Path):
    p = tmp_path / "c.yaml"
    p.write_text("flag: true\n")
    cfg = parse_cli(Cfg, ["--config", str(p), "--no-flag", "--steps", "7"])
    assert cfg.flag is False and cfg.steps == 7


def test_unknown_yaml_key_names_key_and_valid_ones(tmp_path: Path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, p)
    msg = str(e.value)
    assert "optim.lrr" in msg and "optim.lr" in msg and "Did you mean" in msg and "\n" not in msg


def test_unknown_cli_option():
    with pytest.raises(ConfigError, match="unknown key 'stepz'.*steps"):
        parse_cli(Cfg, ["--stepz", "3"])


def test_type_errors():
    with pytest.raises(ConfigError, match="'steps' must be an integer"):
        parse_cli(Cfg, ["steps=1.5"])
    with pytest.raises(ConfigError, match="'flag' must be true or false"):
        load_config(Cfg, None, {"flag": "maybe"})


def test_cli_unknown_command_and_option_one_line(capsys):
    assert main(["nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown command 'nonsense'" in err and len(err.splitlines()) == 1
    assert main(["target", "build", "--bogus-option", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "bogus_option" in err and len(err.splitlines()) == 1


def test_cli_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    assert "target build" in capsys.readouterr().out
