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
from typing import Iterator


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


def write_text(path: str | Path, text: str) -> Path:
    """``path.write_text(text)``, published atomically."""
    with publishing(path) as tmp:
        tmp.write_text(text)
    return Path(path)
