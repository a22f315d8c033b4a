"""Folder locks: one headway process writes a given output folder at a time.

Beside ``publish.py`` (how a finished file or folder appears), this is how a folder being written
is guarded: an exclusive ``flock`` on ``folder/.lock``, held for the whole job by every writer of a
folder (distill, features, merge, prompts, train).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from .publish import check_output_path

LOCK = ".lock"  # held (flock) by the process writing the folder; see output_lock


@contextlib.contextmanager
def output_lock(folder: Path, error: type[Exception], inputs: Sequence[Any] = ()) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``folder/.lock`` while this process writes ``folder`` (checked
    first: not a file, nor the folder of one of the command's ``inputs`` or above it): a second
    headway process writing the same folder fails at once with ``error``, naming the holder,
    instead of interleaving shards and dying later on a raw OSError. The kernel drops the lock when
    the process ends (even on kill -9), so a stale file never blocks. A run that fails (one that
    refuses to start, above all) takes away the lock file and the empty folders it made: no trace
    of a run that never began. A process that opened the file just before it went locks a file no
    longer there; ``_locked`` sees that and locks the new one."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): unguarded, as before
        yield
        return
    check_output_path(folder, "output folder", inputs=inputs, error=error)
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    new_lock = not (folder / LOCK).exists()
    f = _locked(folder, error, fcntl)
    try:
        yield
    except BaseException:
        if new_lock:
            (folder / LOCK).unlink(missing_ok=True)  # while still locked: see _locked
            for p in made:
                with contextlib.suppress(OSError):  # not empty: something else is there now
                    p.rmdir()
        raise
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _locked(folder: Path, error: type[Exception], fcntl: Any) -> Any:
    """``folder/.lock`` opened and flock'ed by this process (its pid written in it), the folder made
    if needed. Locked, the file must still be the one at that path: a failed run removes its lock
    file (``output_lock``), and a lock on the removed file would guard nothing."""
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            f = open(folder / LOCK, "a+")
        except FileNotFoundError:  # the folder went between mkdir and open (a failed run's cleanup)
            continue
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: another process holds it
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise error(f"{folder} is being written by another headway process (pid {holder}); wait for it to "
                        "finish, or choose another output folder") from None
        try:
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(folder / LOCK))
        except FileNotFoundError:
            same = False
        if same:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
            return f
        f.close()  # closing drops the lock on the removed file; lock the one there now
