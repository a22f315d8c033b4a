"""Does the native kernel pay on bfloat16 weights? A few-row product is bound by reading the weights;
a bf16 weight is half the bytes, widened to float32 in registers as it is read. Timed side by side in
one run, interleaved, median of 15, on SmolLM2-135M:

- the target's 211 linears (lm_head included) in bf16: ``F.linear`` against the native kernel, 1-16 rows
  (what ``--dtype bfloat16`` decodes with; the probe now times native on bf16 weights too);
- an EAGLE-3 drafter's linears (fc, one decoder layer, an 8192-token lm_head) in float32 and bf16:
  what a bf16 drafter beside a float32 target reads per drafter call, 1-8 rows.

    python experiments/native_bf16.py [THREADS [HEADS]]   # default: 2, runs/smollm2-eagle3-6k-new/final
"""
import sys
import time

import torch
import torch.nn.functional as F

from headway import native
from headway.heads import load_heads
from headway.kernels import plain_linears
from headway.target import load_target, resolve_target_path

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
heads_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/smollm2-eagle3-6k-new/final"
torch.set_num_threads(threads)
if not native.native_kernel()[0]:
    sys.exit("the native kernel does not build here")
model, _ = load_target(str(resolve_target_path("smollm2")), dtype="bfloat16")
target = [m.weight.contiguous() for m in plain_linears(model)]
drafter = [m.weight.contiguous() for m in plain_linears(load_heads(heads_dir))]
print(f"# {threads} thread(s), {torch.backends.cpu.get_cpu_capability()}; {len(target)} target linears, "
      f"{len(drafter)} drafter linears ({sum(w.numel() for w in drafter) / 1e6:.1f}M weights)")


def pass_times(weights: list[torch.Tensor], rows: int, product, dtype: torch.dtype, reps: int = 15) -> list[float]:
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w in weights}
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for w in weights:
            product(xs[w.shape[1]], w)
        ts.append(time.perf_counter() - t)
    return ts


def table(title: str, weights: dict[str, list[torch.Tensor]], rows: tuple[int, ...]) -> None:
    print(f"\n{title} (ms per pass over the linears, median of 15)")
    print("| rows | " + " | ".join(weights) + " |")
    print("|---" * (len(weights) + 1) + "|")
    with torch.inference_mode():
        for n in rows:
            got: dict[str, list[float]] = {k: [] for k in weights}
            for _ in range(3):  # interleaved: a noisy moment hits every column
                for name, ws in weights.items():
                    product = F.linear if name.endswith("stock") else native.native_linear
                    got[name] += pass_times(ws, n, product, ws[0].dtype, reps=5)
            print(f"| {n} | " + " | ".join(f"{1e3 * sorted(v)[len(v) // 2]:.2f}" for v in got.values()) + " |")


table("SmolLM2-135M target linears, bf16", {"bf16 stock": target, "bf16 native": target}, (1, 2, 4, 8, 16))
table("EAGLE-3 drafter linears", {"fp32 stock": [w.float() for w in drafter], "fp32 native": [w.float() for w in drafter],
                                  "bf16 stock": [w.bfloat16() for w in drafter],
                                  "bf16 native": [w.bfloat16() for w in drafter]}, (1, 2, 4, 8))
