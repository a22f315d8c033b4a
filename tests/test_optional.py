"""Optional dependencies: a missing one is a ``MissingDependency`` whose one line says what to install."""

import sys

import pytest

from headway.errors import HeadwayError
from headway.optional import MissingDependency, available, need, skip_line


def test_a_missing_module_names_itself_and_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency) as e:
        need("matplotlib", "the benchmark plot")
    assert isinstance(e.value, HeadwayError) and isinstance(e.value, ImportError)
    assert str(e.value) == ("the benchmark plot needs matplotlib, which is not installed: "
                            "pip install 'headway[plot]', or pip install matplotlib")
    assert skip_line(e.value, "plot") == ("plot skipped: matplotlib is not installed "
                                          "(pip install 'headway[plot]', or pip install matplotlib)")
    assert not available("matplotlib")


def test_a_submodule_names_the_missing_package_and_present_modules_import(monkeypatch):
    assert need("json", "x") is sys.modules["json"] and available("json")
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")] or ["wandb"]:
        monkeypatch.setitem(sys.modules, name, None)  # a test before may have imported wandb.sdk itself
    with pytest.raises(MissingDependency, match=r"needs wandb, which is not installed: pip install wandb$"):
        need("wandb.sdk", "report_to: wandb")
    with pytest.raises(MissingDependency, match="pip install no_such_pkg_xyz"):
        need("no_such_pkg_xyz", "y")
