"""Does the native kernel's tile path pay? Past 8 rows (draft trees of 9-64 nodes) a product is bound by
its FMAs, not by reading the weights; the kernel then runs register tiles (4 weight rows x 6 input rows,
24 accumulators in AVX-512 registers where built with -mavx512f) instead of 8-row chunks, and with
AVX-512 at 1-8 rows too (one pass, fewer weight rows a tile past 6). Timed side by side in one run,
interleaved, median of 7:

- SmolLM2-135M's 211 linears over 1-64 rows: the kernel as of REV and as it is now, both built with
  the flags headway builds it with;
- whole target forwards of 1-48 query tokens over a 200-token cache (a tree verify): ``F.linear``,
  weight-major, the native kernel now and the native kernel as of REV.

    python experiments/native_tiles.py [THREADS [REV]]   # default: 2, 0707fee (before the tiles)
"""
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load
from transformers import DynamicCache

from headway import native
from headway.compat import cache_kwarg
from headway.kernels import LinearKernels, plain_linears
from headway.target import load_target, resolve_target_path

LINEAR_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32, 48, 64)
FORWARD_TOKENS = (1, 4, 8, 16, 24, 48)
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rev = sys.argv[2] if len(sys.argv) > 2 else "0707fee"
torch.set_num_threads(threads)
flags, link = native._flags()
built = native._build
now = built()[0]
if now is None:
    sys.exit("the native kernel does not build here")
src = Path(tempfile.mkdtemp()) / "fewrow_before.cpp"
src.write_text(subprocess.run(["git", "show", f"{rev}:headway/csrc/fewrow.cpp"], check=True, capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout)
before = load(name=f"headway_fewrow_before_{rev}", sources=[str(src)], extra_cflags=flags, extra_ldflags=link)
model, _ = load_target(str(resolve_target_path("smollm2")), dtype="float32")
weights = [m.weight for m in plain_linears(model.model)]
print(f"# {threads} thread(s), {torch.backends.cpu.get_cpu_capability()}, flags {' '.join(flags)}; "
      f"{len(weights)} linears; kernel before = {rev}")


def median(ts: list[float]) -> float:
    return 1e3 * sorted(ts)[len(ts) // 2]


for n in LINEAR_ROWS:
    xs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}
    ts: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(7):
        for name, mod in (("before", before), ("now", now)):
            t = time.perf_counter()
            for w in weights:
                mod.fewrow(xs[w.shape[1]], w)
            ts[name].append(time.perf_counter() - t)
    b, a = median(ts["before"]), median(ts["now"])
    print(f"linears, {n:2d} rows: before {b:6.1f} ms, now {a:6.1f} ms ({a / b:.2f}x)", flush=True)

kernels = {name: LinearKernels(name, model) for name in ("stock", "weight-major", "native")}
kernels["native before"] = kernels["native"]  # the same plan, with REV's kernel swapped in (below)
ctx = 200
with torch.inference_mode():
    cache = DynamicCache(config=model.config)
    model.model(input_ids=torch.randint(100, 40000, (1, ctx)), **{cache_kwarg(): cache}, use_cache=True)
    for n in FORWARD_TOKENS:
        ids = torch.randint(100, 40000, (1, n))
        pos = torch.arange(ctx, ctx + n)[None]
        mask = torch.zeros(1, 1, n, ctx + n)
        fts: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(7):
            for name, k in kernels.items():
                native._build = (lambda: (before, "")) if name == "native before" else built
                with k():
                    t = time.perf_counter()
                    model.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                                **{cache_kwarg(): cache})
                    fts[name].append(time.perf_counter() - t)
                cache.crop(-n)
        native._build = built
        print(f"forward of {n:2d} tokens: " + ", ".join(f"{name} {median(v):.1f} ms" for name, v in fts.items()),
              flush=True)
