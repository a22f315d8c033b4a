"""Is the cost of a 2-4 row verify on this CPU the kernel's or the memory system's? A hand-written
AVX2/FMA few-row product (each weight row read once, every input row multiplied against it, output
rows split across threads), timed against F.linear and headway's weight-major product over all of
the target's linears. If the hand-written kernel, which reads each weight once whatever the row
count, still costs more at 2-4 rows than at 1, the extra is not MKL's choice of kernel.

Needs a C++ compiler (it is built with torch.utils.cpp_extension, ~1 min, cached by torch); x86-64
with AVX2 and FMA only. Not part of headway: a measurement.

    python experiments/fewrow_native.py [TARGET_DIR [THREADS]]   # default: the cached smollm2 target, 1
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

from headway.kernels import plain_linears, weight_major_linear
from headway.target import load_target

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[j, o] = sum_k x[j, k] * w[o, k] for o in [o0, o1): R weight rows at a time, each read once
template <int N, int R>
static void rows(const float* x, const float* w, float* out, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    __m256 acc[R][N];
    for (int r = 0; r < R; ++r) for (int j = 0; j < N; ++j) acc[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 xv[N];
      for (int j = 0; j < N; ++j) xv[j] = _mm256_loadu_ps(x + j * K + k);
      for (int r = 0; r < R; ++r) {
        __m256 wv = _mm256_loadu_ps(w + (o + r) * K + k);
        for (int j = 0; j < N; ++j) acc[r][j] = _mm256_fmadd_ps(wv, xv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < R; ++r) for (int j = 0; j < N; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t t = k; t < K; ++t) s += w[(o + r) * K + t] * x[j * K + t];
      out[j * O + o + r] = s;
    }
  }
  for (; o < o1; ++o) for (int j = 0; j < N; ++j) {
    float s = 0.f;
    for (int64_t t = 0; t < K; ++t) s += w[o * K + t] * x[j * K + t];
    out[j * O + o] = s;
  }
}

template <int N>
static void run(const float* x, const float* w, float* out, int64_t K, int64_t O) {
  constexpr int R = N <= 2 ? 4 : N <= 4 ? 2 : 1;  // R * N accumulators fit the 16 ymm registers
  at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    rows<N, R>(x, w, out, K, O, b0 * 16, std::min(O, b1 * 16));
  });
}

torch::Tensor fewrow(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) <= 8);
  x = x.contiguous(); w = w.contiguous();
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  int64_t K = x.size(1), O = w.size(0);
  switch (x.size(0)) {
    case 1: run<1>(xp, wp, op, K, O); break;  case 2: run<2>(xp, wp, op, K, O); break;
    case 3: run<3>(xp, wp, op, K, O); break;  case 4: run<4>(xp, wp, op, K, O); break;
    case 5: run<5>(xp, wp, op, K, O); break;  case 6: run<6>(xp, wp, op, K, O); break;
    case 7: run<7>(xp, wp, op, K, O); break;  default: run<8>(xp, wp, op, K, O);
  }
  return out;
}
"""


def main() -> None:
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    default = Path.home() / ".cache/headway/targets/smollm2-0.1.2"  # `headway target build smollm2`
    model, _ = load_target(sys.argv[1] if len(sys.argv) > 1 else str(default), device="cpu")
    native = load_inline("headway_fewrow_probe", cpp_sources=SOURCE, functions=["fewrow"],
                         extra_cflags=["-O3", "-mavx2", "-mfma"]).fewrow
    linears = [m.weight.detach().float().contiguous() for m in plain_linears(model)]
    x = torch.randn(3, linears[0].shape[1])
    torch.testing.assert_close(native(x, linears[0]), F.linear(x, linears[0]), rtol=1e-4, atol=1e-4)
    kernels = {"F.linear": F.linear, "weight-major": weight_major_linear, "hand-written": native}

    def one_pass(rows: int, fn) -> float:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in linears}}
        t0 = time.perf_counter()
        for w in linears:
            fn(xs[w.shape[1]], w)
        return 1000 * (time.perf_counter() - t0)

    counts = (1, 2, 3, 4, 8)
    best = {(n, k): float("inf") for n in counts for k in kernels}
    with torch.inference_mode():
        for _ in range(8):  # interleaved, so a noisy moment hits every kernel
            for n, k in best:
                best[n, k] = min(best[n, k], one_pass(n, kernels[k]))
    print(f"{len(linears)} linears, {torch.get_num_threads()} thread(s); best of 8 passes, ms")
    print(f"{'rows':>4s} " + " ".join(f"{k:>13s}" for k in kernels))
    for n in counts:
        print(f"{n:4d} " + " ".join(f"{best[n, k]:13.1f}" for k in kernels))


if __name__ == "__main__":
    main()
