"""``headway distill --engine vllm``: vLLM writes the answers, in its own virtual environment.

vLLM pins its own torch and transformers, so it runs in another Python (``--vllm-python`` or
$HEADWAY_VLLM_PYTHON) through ``engines.vllm_worker``, started once per run; each shard's turn is
one request, a JSON file of token ids (``engines.vllm_client``). Everything else is ``distill``'s
own: the prompt ids (``plans.make_plan``), the stop tokens (``generation.stop_token_ids``, passed
as ``stop_token_ids``), where an answer ends (``generation.cut_at_stop``), the rows, shards,
resume and manifest. At temperature 0 the rows equal the transformers backend's wherever the
target's fp32 logits are not near-tied; sampled answers are seeded per row (``batch_seed`` of the
row's index), reproducible with vLLM but not equal to transformers' draws.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ..engines.vllm_client import VllmWorker, find_vllm_python
from .generation import Answer, Generate, SamplingSettings, cut_at_stop

if TYPE_CHECKING:
    from .configs import DistillConfig
    from .plans import Plan

WORKDIR = ".vllm"  # in the output folder while the engine runs: requests, results, the worker's log


def max_model_len(plans: Sequence[Plan], max_new_tokens: int, limit: int | None) -> int:
    """The longest conversation the engine must hold: every prompt piece plus an answer per turn
    (capped at the model's ``max_position_embeddings``)."""
    need = max((p.prompt_tokens + len(p.pieces) * max_new_tokens for p in plans), default=max_new_tokens + 1)
    return min(need, limit) if limit else need


def vllm_generate(worker: VllmWorker, settings: SamplingSettings, stop_ids: Sequence[int]) -> Generate:
    """A ``Generate`` answered by the engine: one request per call, one seed per prompt."""
    sample = settings.temperature > 0

    def generate(prompts: list[list[int]], seed: int, seeds: list[int]) -> list[Answer]:
        result = worker.generate({"prompts": prompts, "seeds": seeds if sample else [None] * len(prompts),
                                  "temperature": settings.temperature, "top_p": settings.top_p if sample else 1.0,
                                  "top_k": settings.top_k if sample else 0, "max_tokens": settings.max_new_tokens,
                                  "stop_token_ids": list(stop_ids)})
        return [cut_at_stop(o["token_ids"], stop_ids) for o in result["outputs"]]

    return generate


@contextlib.contextmanager
def vllm_engine(cfg: DistillConfig, model_dir: Path, plans: Sequence[Plan], position_limit: int | None,
                stop_ids: Sequence[int], out: Path, say: Callable[..., Any]) -> Iterator[tuple[Generate, str]]:
    """(generate, "vllm VERSION") while one engine runs; its work folder goes when it ends well
    (a failure keeps it: the error names its log)."""
    python = find_vllm_python(cfg.vllm_python)
    length = max_model_len(plans, cfg.max_new_tokens, position_limit)
    start = time.perf_counter()
    say(f"starting vLLM ({python}, max_model_len {length}); an engine takes a minute or more to start on a CPU")
    with VllmWorker(python, str(model_dir), out / WORKDIR, dtype=cfg.dtype, max_model_len=length,
                    seed=cfg.seed) as worker:
        version = worker.wait_ready()
        say(f"vLLM {version} started in {time.perf_counter() - start:.0f} s")
        yield vllm_generate(worker, cfg.sampling(), stop_ids), f"vllm {version}"
    shutil.rmtree(out / WORKDIR, ignore_errors=True)
