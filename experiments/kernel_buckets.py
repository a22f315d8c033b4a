"""The linear-kernel plan's 9-12 row bucket against the plan it replaced (one 9-16 bucket, decided
at 16 rows), side by side: whole SmolLM2 verify forwards of 9 and 12 tree tokens over a 150-token
cache, the two plans interleaved, median of 7.

    .venv/bin/python experiments/kernel_buckets.py [THREADS]   # default 1
"""
import statistics
import sys
import time

import torch

from headway.decode.kv import new_cache
from headway.decode.tree import tree_mask
from headway.kernels import BUCKETS, LinearKernels, LinearPlan, plain_linears, weight_major
from headway.target import load_target, resolve_target_path

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
model, _ = load_target(resolve_target_path("smollm2"), dtype="float32")
new = LinearKernels("auto", model).plan()
kinds = list(new.kernels)
kinds[BUCKETS.index(12)] = kinds[BUCKETS.index(16)]  # the old bucket ran 9-16 rows with the choice at 16
old = LinearPlan(tuple(kinds), new.widths)
print(f"{torch.get_num_threads()} thread(s); plan: {new.describe()}; before: {old.describe()}")
linears = plain_linears(model)
P = 150
prefix = torch.randint(0, model.config.vocab_size, (1, P))


@torch.inference_mode()
def verify_ms(n: int, plan: LinearPlan) -> float:
    cache = new_cache(model.config)
    model(input_ids=prefix, past_key_values=cache, use_cache=True)
    mask = tree_mask(torch.ones(n, n, dtype=torch.bool).tril(), P, torch.float32, None)
    with weight_major(linears, plan):
        t = time.perf_counter()
        model(input_ids=torch.randint(0, model.config.vocab_size, (1, n)), past_key_values=cache, use_cache=True,
              position_ids=torch.arange(P, P + n)[None], attention_mask=mask)
        return (time.perf_counter() - t) * 1000


for n in (9, 12):
    a, b = [], []
    for _ in range(7):
        a.append(verify_ms(n, new))
        b.append(verify_ms(n, old))
    print(f"{n} tokens: {statistics.median(a):.1f} ms with the plan, {statistics.median(b):.1f} ms before "
          f"({statistics.median(a) / statistics.median(b):.2f}x)")
