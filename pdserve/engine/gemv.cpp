// pdserve's GEMV: y = x @ W.T for a few rows of x, streaming W once, as stored. The engine no longer
// runs it (the native linear kernel's panels serve those rows from the one copy of W they keep,
// panel_matmul.cpp); bench.matmul_kernels keeps it as a reference. This file also holds
// use_avx512(), the instruction-set switch every kernel asks, and the operator library's definition.
//
// W is [out, in] float32, row-major. Output rows are cut into groups of 4 and the groups shared
// out to torch's intra-op threads; each group's 4 weight rows are read once from memory and dotted
// with every row of x while they sit in L1: with AVX2, three rows of x at a time (12 accumulators
// of 8 lanes); where the CPU has AVX-512 (checked once, at run time: the build's flags stay AVX2),
// six rows at a time (24 accumulators of 16 lanes, of the 32 registers), which halves the passes
// over the group and doubles the lanes per instruction. A dot product keeps one register's partial
// sums, added in a fixed order at the end, so a result depends neither on the thread count nor on
// the other rows of x in the call (it does depend on the instruction set: gemv_isa() says which).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdlib>
#include <string>

namespace {

constexpr int64_t kGroupRows = 4;
constexpr int64_t kGrainGroups = 16;  // groups per parallel task: 64 rows, at least 147 KB of W

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// The dot products of `rows` (1..4) consecutive weight rows with `xs` (1..3) rows of x: rows x xs
// independent 8-lane sums, so each output's summation order is the same whatever the blocking (an
// output row's value does not depend on which other rows of x share the call).
template <int64_t rows, int64_t xs>
inline void dot_block(const float* w, const float* x, int64_t k, float* y, int64_t y_stride) {
  __m256 acc[xs][rows];
  for (int64_t j = 0; j < xs; ++j)
    for (int64_t r = 0; r < rows; ++r) acc[j][r] = _mm256_setzero_ps();
  const int64_t vector_end = k - k % 8;
  for (int64_t i = 0; i < vector_end; i += 8) {
    __m256 wv[rows];
    for (int64_t r = 0; r < rows; ++r) wv[r] = _mm256_loadu_ps(w + r * k + i);
    for (int64_t j = 0; j < xs; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * k + i);
      for (int64_t r = 0; r < rows; ++r) acc[j][r] = _mm256_fmadd_ps(wv[r], xv, acc[j][r]);
    }
  }
  for (int64_t j = 0; j < xs; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      float tail = 0.0f;
      for (int64_t i = vector_end; i < k; ++i) tail += w[r * k + i] * x[j * k + i];
      y[j * y_stride + r] = horizontal_sum(acc[j][r]) + tail;
    }
  }
}

// Every row of x against `rows` weight rows, three rows of x at a time.
template <int64_t rows>
inline void dot_rows(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t out) {
  int64_t i = 0;
  for (; i + 3 <= m; i += 3) dot_block<rows, 3>(w, x + i * k, k, y + i * out, out);
  if (m - i == 2) dot_block<rows, 2>(w, x + i * k, k, y + i * out, out);
  if (m - i == 1) dot_block<rows, 1>(w, x + i * k, k, y + i * out, out);
}

// --- AVX-512: the same blocking, 16 lanes and six rows of x ---------------------------------------
#define PDSERVE_AVX512 __attribute__((target("avx512f")))

constexpr int64_t kRowsOfX512 = 6;

// The 16 lanes' sum: the two 8-lane halves added, then the AVX2 path's order.
PDSERVE_AVX512 inline float horizontal_sum512(__m512 v) {
  const __m256 low = _mm512_castps512_ps256(v);
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return horizontal_sum(_mm256_add_ps(low, high));
}

// As dot_block, over 16-lane vectors; the last partial vector of a row is a masked load, so every
// output sums its tail the same way whatever the blocking.
template <int64_t rows, int64_t xs>
PDSERVE_AVX512 inline void dot_block512(const float* w, const float* x, int64_t k, float* y, int64_t y_stride) {
  __m512 acc[xs][rows];
  for (int64_t j = 0; j < xs; ++j)
    for (int64_t r = 0; r < rows; ++r) acc[j][r] = _mm512_setzero_ps();
  const int64_t vector_end = k - k % 16;
  for (int64_t i = 0; i < vector_end; i += 16) {
    __m512 wv[rows];
    for (int64_t r = 0; r < rows; ++r) wv[r] = _mm512_loadu_ps(w + r * k + i);
    for (int64_t j = 0; j < xs; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + j * k + i);
      for (int64_t r = 0; r < rows; ++r) acc[j][r] = _mm512_fmadd_ps(wv[r], xv, acc[j][r]);
    }
  }
  if (vector_end < k) {
    const __mmask16 lanes = __mmask16((1u << (k - vector_end)) - 1);
    __m512 wv[rows];
    for (int64_t r = 0; r < rows; ++r) wv[r] = _mm512_maskz_loadu_ps(lanes, w + r * k + vector_end);
    for (int64_t j = 0; j < xs; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(lanes, x + j * k + vector_end);
      for (int64_t r = 0; r < rows; ++r) acc[j][r] = _mm512_fmadd_ps(wv[r], xv, acc[j][r]);
    }
  }
  for (int64_t j = 0; j < xs; ++j)
    for (int64_t r = 0; r < rows; ++r) y[j * y_stride + r] = horizontal_sum512(acc[j][r]);
}

// Every row of x against `rows` weight rows, six rows of x at a time, then the remainder at once.
template <int64_t rows>
PDSERVE_AVX512 inline void dot_rows512(const float* w, const float* x, int64_t m, int64_t k, float* y,
                                       int64_t out) {
  int64_t i = 0;
  for (; i + kRowsOfX512 <= m; i += kRowsOfX512) dot_block512<rows, kRowsOfX512>(w, x + i * k, k, y + i * out, out);
  switch (m - i) {
    case 5: dot_block512<rows, 5>(w, x + i * k, k, y + i * out, out); break;
    case 4: dot_block512<rows, 4>(w, x + i * k, k, y + i * out, out); break;
    case 3: dot_block512<rows, 3>(w, x + i * k, k, y + i * out, out); break;
    case 2: dot_block512<rows, 2>(w, x + i * k, k, y + i * out, out); break;
    case 1: dot_block512<rows, 1>(w, x + i * k, k, y + i * out, out); break;
    default: break;
  }
}

PDSERVE_AVX512 void group_rows512(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t out) {
  dot_rows512<kGroupRows>(w, x, m, k, y, out);
}

PDSERVE_AVX512 void single_row512(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t out) {
  dot_rows512<1>(w, x, m, k, y, out);
}

void group_rows256(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t out) {
  dot_rows<kGroupRows>(w, x, m, k, y, out);
}

void single_row256(const float* w, const float* x, int64_t m, int64_t k, float* y, int64_t out) {
  dot_rows<1>(w, x, m, k, y, out);
}

using RowsKernel = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t);

}  // namespace

namespace pdserve {

// AVX-512F where the CPU and the OS have it (GCC's check reads CPUID and the enabled XSAVE state),
// unless PDSERVE_CPU_ISA=avx2 caps it (as ONEDNN_MAX_CPU_ISA caps oneDNN): read once per process.
// The GEMV and the prefill attention (prefill_attention.cpp) both ask it.
bool use_avx512() {
  static const bool use = [] {
    const char* cap = std::getenv("PDSERVE_CPU_ISA");
    const std::string isa = cap ? cap : "";
    TORCH_CHECK(isa.empty() || isa == "avx2" || isa == "avx512",
                "PDSERVE_CPU_ISA is '", isa, "': set it to avx2 or avx512, or leave it unset");
    return isa != "avx2" && __builtin_cpu_supports("avx512f");
  }();
  return use;
}

}  // namespace pdserve

std::string gemv_isa() { return pdserve::use_avx512() ? "avx512" : "avx2"; }

torch::Tensor gemv(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [m, in] and w [out, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "gemv: float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "gemv: contiguous CPU tensors only");
  const int64_t m = x.size(0), k = x.size(1), out = w.size(0);
  auto y = torch::empty({m, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const RowsKernel group_rows = pdserve::use_avx512() ? group_rows512 : group_rows256;
  const RowsKernel single_row = pdserve::use_avx512() ? single_row512 : single_row256;
  const int64_t full_groups = out / kGroupRows;
  at::parallel_for(0, full_groups, kGrainGroups, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row = g * kGroupRows;
      group_rows(wp + row * k, xp, m, k, yp + row, out);
    }
  });
  for (int64_t row = full_groups * kGroupRows; row < out; ++row) single_row(wp + row * k, xp, m, k, yp + row, out);
  return y;
}

// Registered as a torch operator, pdserve::gemv, so that profilers see it by name.
TORCH_LIBRARY(pdserve, m) {
  m.def("gemv(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_isa() -> str");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("gemv", &gemv);
}

// No tensor argument to dispatch on: the instruction set gemv runs, for tests and benchmarks.
TORCH_LIBRARY_IMPL(pdserve, CompositeExplicitAutograd, m) {
  m.impl("gemv_isa", &gemv_isa);
}
