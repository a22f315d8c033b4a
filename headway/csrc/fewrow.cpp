// headway's native few-row linear: out = x @ w.T for x of a few rows (register tiles; 1-8 rows streamed
// instead in builds without AVX-512), float32; bfloat16 weights too (widened to float32 as they are
// loaded, always through the tiles): half the bytes to read, which is what bounds a few-row product.
//
// Decoding multiplies a handful of rows by every weight matrix, so up to ~8 rows the product is bound
// by reading the weights. There this kernel reads each weight once whatever the row count: a block of
// R weight rows is streamed once and multiplied against all N input rows (R*N accumulators in registers), with a
// software prefetch a few KB ahead in each streamed row. Without the prefetch, the extra FMAs of a
// second row crowd the loads out of the CPU's window and a 2-row product costs ~1.2-1.4x a 1-row
// one; with it, 1-4 rows cost about one row's time and 8 rows ~1.6x (a 2-core AMD EPYC: see
// headway/native.py). Past 8 rows (draft trees of 9-64 nodes) the multiply-adds bound it instead:
// many() below. GCC/Clang vector extensions: AVX2+FMA where built with -mavx2 -mfma (+ 16-float
// AVX-512 vectors in the tiles with -mavx512f), the compiler's best elsewhere. Threads: ATen's
// intra-op pool, over blocks of 16 (tiles: 32) output rows (ATen's parallel_for is inlined into this
// file, so with an OpenMP build of torch it only runs in parallel when this file is compiled with
// -fopenmp: headway/native.py adds it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 8;                    // floats per vector (256 bits)
constexpr int kStep = 16;                    // floats per row per iteration: one 64-byte line
constexpr int64_t kPrefetch = 2048;          // floats ahead in each streamed row (8 KB)
constexpr int kAccumulators = 8;             // R * N: leaves registers for the loads
constexpr int64_t kGrain = 16;               // output rows per parallel task
constexpr int64_t kChunk = 8;                // rows of x streamed at once (R * N <= kAccumulators)
constexpr int64_t kManyRows = 8;             // more rows than this: register tiles (many())
constexpr int64_t kManyGrain = 32;           // weight rows per parallel task in many(): 32 x K floats in L2

typedef float vec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), __may_alias__));

inline vec load(const float* p) { return *reinterpret_cast<const vec*>(p); }

inline float sum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// out[j * O + o] = dot(x[j], w[o]) for o in [o0, o0 + R): the R weight rows are read once
template <int N, int R>
inline void block(const float* x, const float* w, float* out, int64_t K, int64_t O, int64_t o0) {
  vec acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = vec{};
  const float* wr = w + o0 * K;
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(wr + r * K + k + kPrefetch, 0, 3);
    for (int h = 0; h < kStep; h += kLanes) {
      vec xv[N];
      for (int j = 0; j < N; ++j) xv[j] = load(x + j * K + k + h);
      for (int r = 0; r < R; ++r) {
        const vec wv = load(wr + r * K + k + h);
        for (int j = 0; j < N; ++j) acc[r][j] += wv * xv[j];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) {
      float s = sum(acc[r][j]);
      for (int64_t t = k; t < K; ++t) s += wr[r * K + t] * x[j * K + t];
      out[j * O + o0 + r] = s;
    }
}

// the weight rows [o0, o1) against N rows of x, R weight rows at a time
template <int N>
void span(const float* x, const float* w, float* out, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  constexpr int R = kAccumulators / N >= 8 ? 8 : kAccumulators / N >= 4 ? 4 : kAccumulators / N >= 2 ? 2 : 1;
  int64_t o = o0;
  for (; o + R <= o1; o += R) block<N, R>(x, w, out, K, O, o);
  for (; o < o1; ++o) block<N, 1>(x, w, out, K, O, o);
}

using Span = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
static_assert(kChunk == 8 && kManyRows == kChunk, "one span per row count up to kChunk; more: tiles");
constexpr Span kSpan[8] = {span<1>, span<2>, span<3>, span<4>, span<5>, span<6>, span<7>, span<8>};


// Past ~8 rows the product is bound by the FMAs, not by reading the weights: a tile of kTileW weight
// rows x kTileX rows of x keeps kTileW * kTileX accumulators in registers and loads kTileW + kTileX
// vectors per kTileW * kTileX FMAs, in the CPU's widest vectors (AVX-512 where built with -mavx512f:
// 32 registers hold the 24 accumulators and the loads). A task's 32 weight rows stay in L2 while every
// chunk of x passes them (the first pass reads them from memory, prefetched), so they are read once.
#if defined(__AVX512F__)
constexpr int kWide = 16;
constexpr int kTileW = 4;
constexpr int kTileX = 6;
#else
constexpr int kWide = 8;
constexpr int kTileW = 2;
constexpr int kTileX = 6;
#endif
typedef float wide __attribute__((vector_size(kWide * sizeof(float)), aligned(4), __may_alias__));

inline wide load_wide(const float* p) { return *reinterpret_cast<const wide*>(p); }

// bfloat16 is the high half of a float32: widen by shifting the 16 bits up
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
inline wide load_wide(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (wide)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (wide)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  wide v;
  for (int i = 0; i < kWide; ++i) v[i] = to_float(p[i]);
  return v;
#endif
}

// the lanes' sum, in registers (a lane-by-lane sum, or one through memory, costs about what the FMAs of
// a 576-long dot product do)
#if defined(__AVX512F__)
inline float sum_wide(wide v) { return _mm512_reduce_add_ps((__m512)v); }
#elif defined(__AVX__)
inline float sum_wide(wide v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  const __m128 h = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#else
inline float sum_wide(wide v) {
  float s = 0.f;
  for (int i = 0; i < kWide; ++i) s += v[i];
  return s;
}
#endif

// out[j * O + o] = dot(x[j], w[o]) for o in [o0, o0 + R), j < N; Fetch: prefetch the weights ahead
// (the first chunk of x to pass a block of weight rows reads them from memory, the others from L2)
template <int N, int R, bool Fetch, typename W>
inline void tile(const float* x, const W* w, float* out, int64_t K, int64_t O, int64_t o0) {
  wide acc[R][N];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) acc[r][j] = wide{};
  const W* wr = w + o0 * K;
  int64_t k = 0;
  for (; k + kWide <= K; k += kWide) {
    if (Fetch)
      for (int r = 0; r < R; ++r) __builtin_prefetch(wr + r * K + k + kPrefetch, 0, 3);
    wide wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_wide(wr + r * K + k);
    for (int j = 0; j < N; ++j) {
      const wide xv = load_wide(x + j * K + k);
      for (int r = 0; r < R; ++r) acc[r][j] += wv[r] * xv;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < N; ++j) {
      float s = sum_wide(acc[r][j]);
      for (int64_t t = k; t < K; ++t) s += to_float(wr[r * K + t]) * x[j * K + t];
      out[j * O + o0 + r] = s;
    }
}

// N rows of x against the weight rows [o0, o1), kTileW at a time (fewer past kTileX rows: as many
// accumulators as a kTileW x kTileX tile)
template <int N, bool Fetch, typename W>
void tile_span(const float* x, const W* w, float* out, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  constexpr int R = N <= kTileX ? kTileW : std::max(1, kTileW * kTileX / N);
  int64_t o = o0;
  for (; o + R <= o1; o += R) tile<N, R, Fetch>(x, w, out, K, O, o);
  for (; o < o1; ++o) tile<N, 1, Fetch>(x, w, out, K, O, o);
}

template <bool Fetch, typename W>
void tile_rows(int m, const float* x, const W* w, float* out, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  switch (m) {
    case 1: tile_span<1, Fetch>(x, w, out, K, O, o0, o1); break;
    case 2: tile_span<2, Fetch>(x, w, out, K, O, o0, o1); break;
    case 3: tile_span<3, Fetch>(x, w, out, K, O, o0, o1); break;
    case 4: tile_span<4, Fetch>(x, w, out, K, O, o0, o1); break;
    case 5: tile_span<5, Fetch>(x, w, out, K, O, o0, o1); break;
    default: tile_span<6, Fetch>(x, w, out, K, O, o0, o1); break;
  }
}
static_assert(kTileX == 6, "tile_rows() covers 1 to kTileX rows");

// 1-8 rows of x, all in one tile's pass, against the weight rows [o0, o1)
template <typename W>
void few_tiles(int n, const float* x, const W* w, float* out, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  switch (n) {
    case 7: tile_span<7, true>(x, w, out, K, O, o0, o1); break;
    case 8: tile_span<8, true>(x, w, out, K, O, o0, o1); break;
    default: tile_rows<true>(n, x, w, out, K, O, o0, o1); break;
  }
}
static_assert(kTileX == 6 && kManyRows == 8, "few_tiles() covers 1 to kManyRows rows");

// With AVX-512 the tiles beat the streamed spans at 1-8 rows too: SmolLM2's linears took 0.87-0.97x
// the time on a 2-core Xeon (1 and 2 threads; experiments/native_tiles.py). AVX2 builds keep the spans.
#if defined(__AVX512F__)
constexpr bool kFewTiles = true;
#else
constexpr bool kFewTiles = false;
#endif

// all n rows of x against the weight rows [o0, o1) (kManyGrain of them fit in L2), kTileX rows at a time:
// a chunk of x stays in L1 while the weight rows stream past it
template <typename W>
void many(const float* x, const W* w, float* out, int64_t n, int64_t K, int64_t O, int64_t o0, int64_t o1) {
  for (int64_t j = 0; j < n; j += kTileX) {
    const int m = static_cast<int>(std::min<int64_t>(kTileX, n - j));
    if (j == 0)
      tile_rows<true>(m, x, w, out, K, O, o0, o1);
    else
      tile_rows<false>(m, x + j * K, w, out + j * O, K, O, o0, o1);
  }
}

// all n rows of x against all O weight rows in tiles, over parallel tasks of kManyGrain weight rows
template <typename W>
void tiled(const float* xp, const W* wp, float* op, int64_t n, int64_t K, int64_t O) {
  at::parallel_for(0, (O + kManyGrain - 1) / kManyGrain, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kManyGrain, o1 = std::min(O, (b + 1) * kManyGrain);
      if (n > kManyRows)
        many(xp, wp, op, n, K, O, o0, o1);
      else
        few_tiles(static_cast<int>(n), xp, wp, op, K, O, o0, o1);
    }
  });
}

}  // namespace

// x: (n, in), w: (out, in) -> (n, out) in x's dtype. float32 weights: register tiles past 8 rows, and
// at 1-8 with AVX-512. bfloat16 weights (x float32 or bfloat16, computed in float32): tiles at every count.
torch::Tensor fewrow(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "fewrow: x (n, in) and w (out, in)");
  const bool half = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(half ? (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16)
                   : (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat),
              "fewrow: float32 x and weight, or a bfloat16 weight");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "fewrow: CPU tensors only");
  TORCH_CHECK(w.is_contiguous(), "fewrow: the weight must be contiguous");
  const auto dtype = x.scalar_type();
  x = x.to(at::kFloat).contiguous();
  const int64_t n = x.size(0), K = x.size(1), O = w.size(0);
  auto out = torch::empty({n, O}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (n == 0) return out.to(dtype);
  if (half) {
    tiled(xp, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), op, n, K, O);
    return out.to(dtype);
  }
  const float* wp = w.data_ptr<float>();
  if (n > kManyRows || kFewTiles) {
    tiled(xp, wp, op, n, K, O);
    return out;
  }
  at::parallel_for(0, (O + kGrain - 1) / kGrain, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      kSpan[n - 1](xp, wp, op, K, O, b * kGrain, std::min(O, (b + 1) * kGrain));  // all n <= 8 rows at once
    }
  });
  return out;
}

// how many of ATen's threads a parallel loop over n tasks (as fewrow's) runs on: a build without
// the parallel backend's flags runs every loop on one
int64_t parallel_width(int64_t n) {
  std::atomic<int64_t> widest{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int64_t mine = at::get_thread_num() + 1;
    int64_t seen = widest.load();
    while (mine > seen && !widest.compare_exchange_weak(seen, mine)) {}
  });
  return widest.load();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fewrow", &fewrow, "x @ w.T for a few rows of x, reading each weight once");
  m.def("parallel_width", &parallel_width, "threads a parallel loop over n tasks runs on");
}
