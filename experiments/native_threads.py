"""Does headway's native few-row kernel use torch's threads? SmolLM2-135M's 211 linears over 1-64 rows,
timed side by side in one run: ``F.linear`` (MKL), the kernel built without -fopenmp (as headway built
it before: ATen's ``parallel_for`` is a header template, so with torch's OpenMP backend it compiled to
a serial loop) and with it (as ``headway.native`` builds it now). Best of 3 passes each.

    python experiments/native_threads.py [THREADS [TARGET_DIR]]   # default: 2, the cached smollm2 target
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from headway import native
from headway.kernels import plain_linears
from headway.target import load_target

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
target = sys.argv[2] if len(sys.argv) > 2 else str(Path.home() / ".cache/headway/targets/smollm2-0.1.2")
flags, _ = native._flags()
serial = [f for f in flags if f != "-fopenmp"]
builds = {name: native._load(cflags, link)[0] for name, cflags, link in
          (("serial build", serial, []), ("OpenMP build", serial + ["-fopenmp"], ["-fopenmp"]))}
if not all(builds.values()):
    sys.exit("the native kernel does not build here")
builds = {name: module.fewrow for name, module in builds.items()}
torch.set_num_threads(threads)
model, _ = load_target(target, device="cpu")
linears = plain_linears(model)
params = sum(m.weight.numel() for m in linears)
kernels = {"F.linear": lambda x, w: F.linear(x, w), **builds}


def best(rows: int, fn) -> float:
    xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in linears}
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for m in linears:
            fn(xs[m.weight.shape[1]], m.weight)
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


with torch.inference_mode():
    for fn in kernels.values():
        best(4, fn)  # warm-up: pages, kernel selection
    print(f"{len(linears)} linears, {params / 1e6:.1f}M weights, {threads} thread(s); ms per pass (GFLOP/s)")
    print(f"{'rows':>5} " + " ".join(f"{k:>22}" for k in kernels))
    for rows in (1, 2, 4, 8, 9, 12, 16, 17, 24, 32, 48, 64):
        ms = [best(rows, fn) for fn in kernels.values()]
        print(f"{rows:>5} " + " ".join(f"{t:>11.1f} ({2 * rows * params / t / 1e6:5.1f})".rjust(22) for t in ms),
              flush=True)
