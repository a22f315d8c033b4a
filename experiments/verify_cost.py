"""Where the speculative verify forward's extra cost comes from: stock-model forwards of 1, 2 and 8 query
tokens over a cached prefix, with and without headway's 4D mask and hidden states (CPU), with the
stock linears (F.linear), with headway's weight-major ones (``headway.kernels``), with those padded
to the next power of two of columns (the width ``auto`` may pick per row count) and with headway's
native few-row kernel (``headway.native``, built on first use).

    python experiments/verify_cost.py [TARGET_DIR [THREADS]]    # default: the cached smollm2 target, 2
"""
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from headway.kernels import LinearPlan, plain_linears, weight_major
from headway.target import load_target

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
default = Path.home() / ".cache/headway/targets/smollm2-0.1.2"  # `headway target build smollm2`
model, _ = load_target(sys.argv[1] if len(sys.argv) > 1 else str(default), device="cpu")
model.eval()
ids = torch.randint(100, 40000, (1, 120))
def prefix():
    c = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=c, use_cache=True)
    return c
def run(n_new, mask, hidden, reps=12):
    ts = []
    for _ in range(reps):
        c = prefix()
        P = c.get_seq_length()
        x = torch.randint(100, 40000, (1, n_new))
        kw = dict(input_ids=x, past_key_values=c, use_cache=True, output_hidden_states=hidden,
                  position_ids=torch.arange(P, P + n_new)[None])
        if mask:
            m = torch.zeros(1, 1, n_new, P + n_new)
            m[..., P:] = torch.triu(torch.full((n_new, n_new), torch.finfo(torch.float32).min), 1)
            kw["attention_mask"] = m
        with torch.no_grad():
            t = time.perf_counter(); model(**kw); ts.append(time.perf_counter() - t)
    ts.sort(); return 1000 * ts[len(ts) // 2]
linears = plain_linears(model)
padded = LinearPlan(LinearPlan.everywhere().kernels, widths=(2, 2, 4, 4, 8, 8, 8, 8))  # n rows as 2^k
print(f"{torch.get_num_threads()} threads; median of 12 forwards")
print(f"{'forward':28s} {'F.linear':>9s} {'weight-major':>13s} {'padded':>10s} {'native':>10s}")
for name, args in [("1 tok, plain", (1, False, False)), ("1 tok, hidden", (1, False, True)),
                   ("2 tok, plain", (2, False, False)), ("2 tok, 4D mask", (2, True, False)),
                   ("2 tok, 4D mask + hidden", (2, True, True)), ("3 tok, 4D mask + hidden", (3, True, True)),
                   ("4 tok, 4D mask + hidden", (4, True, True)), ("6 tok, 4D mask + hidden", (6, True, True)),
                   ("8 tok, 4D mask + hidden", (8, True, True)), ("17 tok, 4D mask + hidden", (17, True, True))]:
    stock = run(*args)
    with weight_major(linears, LinearPlan.everywhere()):
        wm = run(*args)
    with weight_major(linears, padded):
        pad = run(*args)
    with weight_major(linears, LinearPlan.everywhere("native")):
        nat = run(*args)
    print(f"{name:28s} {stock:6.1f} ms {wm:10.1f} ms {pad:7.1f} ms {nat:7.1f} ms")
