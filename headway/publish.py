"""The one atomic-publish helper: every writer of a file or folder others read goes through it.

Write into a temp sibling of the final path, fsync, give it the modes a plain ``open`` / ``mkdir``
would have (``tempfile`` makes them private), then rename it onto the final path: a reader sees
the old version or the new one, never half of one, and an interrupted writer leaves only a
``<name>.tmp<pid>`` sibling behind. Nothing else in headway renames a temp into place
(``tests/test_architecture.py`` checks).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence


def umask_mode(folder: bool) -> int:
    """The mode a new file (or folder) gets under the current umask."""
    mask = os.umask(0o022)  # reading the umask means setting it; restored at once
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _settle(tmp: Path) -> None:
    """fsync and plain modes for ``tmp`` and everything under it."""
    paths = [tmp, *tmp.rglob("*")] if tmp.is_dir() else [tmp]
    for p in paths:
        if p.is_symlink():
            continue
        os.chmod(p, umask_mode(p.is_dir()))
        if p.is_file():
            _fsync(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def temp_sibling(final: Path) -> Path:
    """The temp name a writer of ``final`` uses: ``<name>.tmp<pid>`` beside it, so that a cleaner of
    stale temporaries (``data.shards.remove_stale``) can find what a killed run left."""
    return final.with_name(f"{final.name}.tmp{os.getpid()}")


def remove_dead_temps(final: Path) -> list[Path]:
    """Delete ``<name>.tmp<pid>`` siblings of ``final`` whose writer is no longer running on this
    machine (a killed build); returns what it removed. Only for folders one machine writes (a
    cache): on a filesystem shared between nodes another node's pid means nothing here."""
    removed = []
    for p in final.parent.glob(f"{final.name}.tmp*"):
        pid = p.name[len(final.name) + 4:]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: does the process exist?
        except ProcessLookupError:
            _remove(p)
            removed.append(p)
        except PermissionError:  # alive, another user's: keep it
            continue
    return removed


def publish(tmp: str | Path, final: str | Path, *, replace: bool = True) -> Path:
    """Publish a finished temp file or folder ``tmp`` as ``final`` (fsync, plain modes, rename):
    the step ``publishing`` ends with, for a writer whose temp must have a name of its own (every
    process of a distributed checkpoint writes into one folder). Without ``replace`` an existing
    ``final`` wins and ``tmp`` is left for the caller to remove."""
    tmp, final = Path(tmp), Path(final)
    _settle(tmp)
    if final.exists() and not replace:
        return final
    if tmp.is_dir() and final.is_dir():  # a folder cannot be renamed onto a non-empty one: swap it aside
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, old / "x")
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(old / "x", final)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


@contextlib.contextmanager
def publishing(final: str | Path, *, folder: bool = False, replace: bool = True) -> Iterator[Path]:
    """Yield a temp sibling of ``final`` to write (a fresh path, or an empty folder when ``folder``).
    When the block ends without error the temp is published as ``final``, file or folder. Without
    ``replace`` an existing ``final`` wins (a concurrent writer of the same thing finished first)
    and ours is dropped. On error nothing is published and the temp is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(final)
    _remove(tmp)  # left by a killed writer of the same pid
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        publish(tmp, final, replace=replace)
    finally:
        _remove(tmp)


class OutputPathError(ValueError):
    """An output path no writer could use; each room raises the message again as its own error."""


def check_output_path(path: str | Path, what: str, *, file: bool = False, inputs: Sequence[str | Path | None] = (),
                      below_inputs: bool = True, replaced: bool = False,
                      error: type[Exception] = OutputPathError) -> Path:
    """``path`` resolved (``~``, ``.``, ``..``, links), after refusing up front, with one line that
    names ``what`` (``--out``): a file where a folder goes (or a folder where a ``file`` goes), a
    parent that is a file, an input itself, a folder that holds an input (replacing or emptying the
    output would take the input with it), unless ``below_inputs`` a folder inside an input, and for a
    folder ``replaced`` whole (``publishing``) the current folder or one holding it (the shell would
    be left in a deleted folder). ``inputs`` that are unset or not here (a Hub repo id) are skipped.
    Raises ``error`` (a room's own)."""
    given = str(path)
    out = Path(path).expanduser().resolve()
    if replaced and (out == Path.cwd() or out in Path.cwd().parents):
        raise error(f"{what} {given} {'is' if out == Path.cwd() else 'holds'} the current folder, and the output "
                    "replaces its folder whole; name a new folder")
    if out.exists() and out.is_dir() == file:
        raise error(f"{what} {given} is a folder; give a file name" if file else
                    f"{what} {given} is a file, not a folder; choose a folder")
    parent = next((p for p in Path(path).expanduser().parents if p.exists()), None)  # named as given
    if parent is not None and not out.exists() and not parent.is_dir():
        raise error(f"{what} {given}: {parent} is a file, not a folder")
    for name in inputs:
        inp = Path(name or "").expanduser()
        if not name or not inp.exists():
            continue
        inp = inp.resolve()
        if out == inp:
            raise error(f"{what} {given} is the input {name} itself; choose a new folder")
        if out in inp.parents:
            raise error(f"{what} {given} holds the input {name}; choose a new folder outside it")
        if not below_inputs and inp in out.parents:
            raise error(f"{what} {given} is inside the input {name}; choose a new folder outside it")
    return out


def check_replaceable(folder: Path, name: str, earlier: str, is_earlier: Callable[[Path], bool],
                      allowed: Callable[[str], bool], error: type[Exception] = OutputPathError) -> bool:
    """Whether the output ``folder`` (``name`` in messages: ``--out R``) holds something to replace.
    False: it is new or empty. True: it holds an earlier ``earlier`` (``is_earlier``) and only files
    ``allowed`` names. Anything else is refused with ``error``, naming what is there: replacing the
    folder would delete it."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return False
    earlier_one = is_earlier(folder)
    foreign = sorted(p.name + "/" * p.is_dir() for p in folder.iterdir()
                     if not earlier_one or p.is_dir() or not allowed(p.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise error(f"{name} holds files that are not an earlier {earlier} ({shown}); choose a new folder")
    return True


def write_text(path: str | Path, text: str) -> Path:
    """``path.write_text(text)``, published atomically."""
    with publishing(path) as tmp:
        tmp.write_text(text)
    return Path(path)
