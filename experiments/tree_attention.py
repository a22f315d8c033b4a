"""Does grouped-query tree attention (``headway/decode/attention.py``) pay? Timed side by side in one
run, interleaved, median of REPS:

- one layer's attention: 9 query heads on 3 key/value heads (SmolLM2's), 64 dims, a 200-token cache and
  q tree tokens under a random tree mask: transformers' sdpa path (``repeat_kv`` + PyTorch's CPU
  flash kernel) against ``grouped_attention``;
- whole verify forwards of the cached SmolLM2 target over q tree tokens on a 200-token cache, with
  the native linear kernel (where it builds; else auto's plan), sdpa against grouped attention.

    python experiments/tree_attention.py [THREADS [REPS]]   # default: 2 threads, 9 reps
"""
import sys
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from headway import native
from headway.compat import cache_kwarg
from headway.decode.attention import grouped_attention, tree_attention
from headway.decode.tree import tree_mask
from headway.kernels import LinearKernels
from headway.target import load_target, resolve_target_path

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
torch.set_num_threads(threads)
ctx, sizes = 200, (4, 8, 16, 24, 32, 48)


def random_tree_mask(q: int, prefix: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(q)
    visible = (torch.rand(q, q, generator=g) < 0.3).tril()
    visible.fill_diagonal_(True)
    return tree_mask(visible, prefix, torch.float32)


def median_ms(ts: list[float]) -> float:
    return 1e3 * sorted(ts)[len(ts) // 2]


print(f"# {threads} thread(s), {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
with torch.inference_mode():
    for q in sizes:
        query = torch.randn(1, 9, q, 64)
        key, value = torch.randn(1, 3, ctx + q, 64), torch.randn(1, 3, ctx + q, 64)
        mask = random_tree_mask(q, ctx)

        def sdpa() -> torch.Tensor:  # what transformers' sdpa_attention_forward runs for a 4-D float mask
            k = key[:, :, None].expand(1, 3, 3, ctx + q, 64).reshape(1, 9, ctx + q, 64)
            v = value[:, :, None].expand(1, 3, 3, ctx + q, 64).reshape(1, 9, ctx + q, 64)
            return F.scaled_dot_product_attention(query, k, v, attn_mask=mask).transpose(1, 2).contiguous()

        fns = {"sdpa": sdpa, "grouped": lambda: grouped_attention(query, key, value, mask, 0.125)}
        ts: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                t = time.perf_counter()
                for _ in range(30):  # one forward's worth of layers
                    fn()
                ts[name].append((time.perf_counter() - t) / 30)
        a, b = median_ms(ts["sdpa"]), median_ms(ts["grouped"])
        print(f"attention, {q:2d} queries: sdpa {1e3 * a:6.0f} us, grouped {1e3 * b:6.0f} us ({b / a:.2f}x)",
              flush=True)

    model, _ = load_target(str(resolve_target_path("smollm2")), dtype="float32")
    kernels = LinearKernels("native" if native.native_kernel()[0] else "auto", model)
    kernels.plan()
    cache = DynamicCache(config=model.config)
    model.model(input_ids=torch.randint(100, 40000, (1, ctx)), **{cache_kwarg(): cache}, use_cache=True)
    for q in sizes:
        ids = torch.randint(100, 40000, (1, q))
        pos = (ctx + torch.arange(q))[None]
        mask = random_tree_mask(q, ctx)
        ts = {"sdpa": [], "grouped": []}
        for _ in range(reps):
            for name in ts:
                with kernels(), tree_attention(model, enabled=name == "grouped"):
                    t = time.perf_counter()
                    model.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                                **{cache_kwarg(): cache})
                    ts[name].append(time.perf_counter() - t)
                cache.crop(-q)
        a, b = median_ms(ts["sdpa"]), median_ms(ts["grouped"])
        print(f"forward of {q:2d} tokens ({kernels.kernel} linears): sdpa {a:6.1f} ms, grouped {b:6.1f} ms "
              f"({b / a:.2f}x)", flush=True)
