"""What a reduced draft vocabulary saves: per-call drafter cost and Medusa training throughput.

A SmolLM2-135M-shaped random target (hidden 576, vocab 49,152; 2 layers: the target's depth does
not enter the drafter's cost), an EAGLE-1 drafter and 5 Medusa heads, each with the full
vocabulary and with N = 16384 / 8192 draft tokens. Reported: median milliseconds of one EAGLE-1
tree expansion (4 nodes, 128 cached positions: one ``EagleProposer.expand``, log-softmax
included), of one Medusa drafting call (``MedusaProposer`` on a new hidden state: K heads and
their log-softmax), and Medusa training tokens per second (B x T positions of stored hidden
states through ``MedusaTask.loss``, backward and AdamW; the target does not run, as with
``features=DIR``).

    .venv/bin/python experiments/draft_vocab_cost.py [--threads 1] [--calls 50] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from headway.config import load_config
from headway.decode.proposers import make_proposer
from headway.heads import Eagle1Drafter, MedusaHeads
from headway.train.batch import TargetBatch
from headway.train.config import TrainConfig
from headway.train.tasks import MedusaTask

SIZES: list[int | None] = [None, 16384, 8192]  # None = the full vocabulary (the behaviour before)


def smollm2_shaped_target() -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def median_ms(fn: Callable[[], object], calls: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def vocab(n: int | None, V: int) -> torch.Tensor | None:
    return None if n is None else torch.randperm(V, generator=torch.Generator().manual_seed(1))[:n]


@torch.inference_mode()
def eagle1_expand_ms(target: torch.nn.Module, n: int | None, calls: int) -> float:
    V, H = target.config.vocab_size, target.config.hidden_size
    drafter = Eagle1Drafter.for_target(target, draft_vocab=vocab(n, V)).eval()
    proposer = make_proposer(drafter)
    ctx = 128
    ids = torch.randint(0, V, (1, ctx))
    proposer.prefill(ids, torch.ones_like(ids, dtype=torch.bool), torch.arange(ctx)[None], [torch.randn(1, ctx, H)],
                     torch.tensor([5]))
    nodes = torch.randint(0, V, (1, 4))

    def call() -> torch.Tensor:
        proposer.root_logprobs()
        out = proposer.expand(torch.zeros(1, 4, dtype=torch.long), nodes, 1)  # (1, 4, Vd)
        proposer.end_tree()
        return out

    return median_ms(call, calls)


@torch.inference_mode()
def medusa_call_ms(target: torch.nn.Module, n: int | None, calls: int, heads: int = 5) -> float:
    V, H = target.config.vocab_size, target.config.hidden_size
    proposer = make_proposer(MedusaHeads.for_target(target, num_heads=heads, draft_vocab=vocab(n, V)).eval())
    h = torch.randn(1, H)
    return median_ms(lambda: proposer.accept([torch.zeros(2, dtype=torch.long)], [[h]], [0]), calls)


def medusa_train_tokens_per_s(target: torch.nn.Module, n: int | None, steps: int, B: int = 4, T: int = 256,
                              heads: int = 5) -> float:
    V, H = target.config.vocab_size, target.config.hidden_size
    task = MedusaTask(load_config(TrainConfig, None, {"target": "demo", "medusa.num_heads": heads}))
    model = MedusaHeads.for_target(target, num_heads=heads, draft_vocab=vocab(n, V))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    tb = TargetBatch(ids, torch.ones_like(ids), torch.ones_like(ids), {-1: torch.randn(B, T, H, generator=g)})

    def step() -> None:
        loss, _ = task.loss(model, tb, 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return B * T / (median_ms(step, steps, warmup=1) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=50, help="timed drafter calls per setting")
    ap.add_argument("--steps", type=int, default=4, help="timed Medusa training steps per setting")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = smollm2_shaped_target()
    V = target.config.vocab_size
    print(f"SmolLM2-shaped target: hidden {target.config.hidden_size}, vocab {V}; {args.threads} thread(s)")
    print(f"{'draft vocab':>12} | {'EAGLE-1 expand ms':>17} | {'Medusa (5 heads) ms':>19} | {'Medusa train tok/s':>18}")
    for n in SIZES:
        e = eagle1_expand_ms(target, n, args.calls)
        m = medusa_call_ms(target, n, args.calls)
        t = medusa_train_tokens_per_s(target, n, args.steps)
        print(f"{n or V:>12} | {e:>17.2f} | {m:>19.2f} | {t:>18.0f}")


if __name__ == "__main__":
    main()
