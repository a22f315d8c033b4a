"""The vLLM side of ``headway distill --engine vllm``: runs in vLLM's own virtual environment and
imports only the standard library and vllm (never headway: that environment has neither headway nor
its torch / transformers versions).

    VLLM_PYTHON vllm_worker.py WORKDIR

``WORKDIR/engine.json`` names the model and the engine's settings (``model``, ``dtype``,
``max_model_len``, ``seed``, ``parent_pid``; optionally ``speculative_config``, vLLM's own dict,
which also turns on vLLM's statistics so that its spec-decode counters can be read). The worker starts one engine, writes ``ready.json``
(``{"vllm": version}``), then answers ``req-00001.json``, ``req-00002.json``, ... with
``res-NNNNN.json``, in order, until a request says ``{"stop": true}`` or the parent process is gone
(a thread watches for that even mid-request, so a killed headway leaves no engine behind). A request::

    {"prompts": [[ids]], "seeds": [int | null], "temperature": float, "top_p": float, "top_k": int,
     "max_tokens": int, "stop_token_ids": [int]}

and its result ``{"outputs": [{"token_ids": [...], "finish_reason": "stop" | "length"}]}``; a request
with ``"metrics": true`` also gets ``"metrics"``: vLLM's ``vllm:spec_decode*`` counters after it, as
``{name: number}`` (``{name: [number per draft position]}`` for a vector), summed over engines. Every
file is written under a temporary name and renamed: a reader never sees half a file. A failure
writes ``error.json`` (``{"phase": "import" | "start" | "generate", "error": "Type: message"}``)
and exits 1.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path


def write(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)  # atomic-publish: this worker imports only the stdlib, not headway.publish


def wait_for(path: Path, parent: int) -> "dict | None":
    """The request at ``path`` once it exists; None when the parent (headway) has gone."""
    delay = 0.005
    while not path.exists():
        if os.getppid() != parent:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return json.loads(path.read_text())


def watch_parent(parent: int) -> None:
    """End this process group (the worker and vLLM's engine processes) once headway is gone, even in
    the middle of a request: a killed headway must not leave an engine computing for nobody."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(os.getpgid(0), signal.SIGTERM)  # headway started the worker in a session of its own
    time.sleep(5)
    os._exit(1)


def answer(llm: object, sampling_params: type, req: dict) -> dict:
    """One request: a list of SamplingParams (one seed per prompt, so a row's sample does not depend
    on which other rows share its batch)."""
    params = [sampling_params(temperature=req["temperature"], top_p=req["top_p"], top_k=req["top_k"],
                              max_tokens=req["max_tokens"], seed=seed, stop_token_ids=req["stop_token_ids"],
                              detokenize=False)
              for seed in req["seeds"]]
    outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
    result = {"outputs": [{"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason}
                          for o in outs]}
    if req.get("metrics"):
        result["metrics"] = spec_metrics(llm)
    return result


def spec_metrics(llm: object) -> dict:
    """vLLM's spec-decode counters now (cumulative since the engine started), summed over engines:
    a counter as a number, a vector (one count per draft position) as a list."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if isinstance(m, Vector):
            old = out.get(m.name, [])
            width = max(len(old), len(m.values))
            out[m.name] = [(old[i] if i < len(old) else 0) + (m.values[i] if i < len(m.values) else 0)
                           for i in range(width)]
        elif isinstance(m, Counter):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def main(workdir: Path) -> int:
    job = json.loads((workdir / "engine.json").read_text())
    threading.Thread(target=watch_parent, args=(job["parent_pid"],), daemon=True).start()
    phase = "import"
    try:
        import vllm
        from vllm import LLM, SamplingParams

        phase = "start"
        # generation_config="vllm": neutral sampling defaults; the stop tokens come with each request
        spec = job.get("speculative_config")  # a drafter: with vLLM's stats on, so its counters count
        drafting = {"speculative_config": spec, "disable_log_stats": False} if spec else {}
        llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"], seed=job["seed"],
                  enforce_eager=True, generation_config="vllm", **drafting)
        write(workdir / "ready.json", {"vllm": getattr(vllm, "__version__", "unknown")})
        phase = "generate"
        n = 1
        while True:
            req = wait_for(workdir / f"req-{n:05d}.json", job["parent_pid"])
            if req is None or req.get("stop"):
                return 0
            write(workdir / f"res-{n:05d}.json", answer(llm, SamplingParams, req))
            n += 1
    except BaseException as e:  # noqa: BLE001  every failure becomes one line for headway
        write(workdir / "error.json", {"phase": phase, "error": f"{type(e).__name__}: {e}"})
        raise


if __name__ == "__main__":  # the guard vLLM's multiprocess engine needs (it re-imports __main__)
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main(Path(sys.argv[1])))
