"""tools/loc.py, the lines-of-code count the decode room's size goal is measured with (not part of the package)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("loc_tool", ROOT / "tools" / "loc.py")
loc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loc)

SOURCE = '''"""A module docstring,
over two lines."""

import os  # a comment after code counts


def f(x):
    """A function docstring."""
    # a comment line
    y = (x +
         1)

    return y


class C:
    """One line."""

    z = """a string that is not a docstring"""
'''


def test_counts_code_lines_only():
    # import, def, y = ( and its continuation, return, class, z: docstrings, comments and blanks left out
    assert loc.lines_of_code(SOURCE) == 7


def test_counts_the_package_files(capsys):
    assert loc.main([str(ROOT / "tools" / "loc.py")]) == 0
    out = capsys.readouterr().out
    assert "tools/loc.py" in out and "lines of code in 1 files" in out
