// pdserve's panel matmul: y = x @ W.T for any number of rows of x (a decode step's one row a
// sequence, a short suffix after a cached prefix, a prefill chunk of thousands), streaming W once
// per block of rows from a layout packed at load: the native linear kernel (pdserve/engine/linear.py)
// runs it at every row count, from the one copy of W it keeps.
//
// Why: up to a few hundred rows a product is close to bound by reading W, and oneDNN and a GEMV over
// W as stored read it well below the rate a plain read of it reaches (python -m bench.matmul_kernels;
// docs/benchmarks.md). Here W [out, in] is packed as panels of P output columns
// (P = 2 vectors: 32 on AVX-512, 16 on AVX2), each panel [in][P] contiguous, so one pass over a
// panel streams its bytes in order. For each block of up to kBlockRows rows of x, a step over `in`
// loads the panel's 2 vectors at that input and broadcasts each row's x into 2 FMAs: 2 x 14 sums in
// 28 of AVX-512's 32 registers (2 x 6 of AVX2's 16), so a block of rows costs one read of the
// panel, and the blocks after the first read it from L2. A prefetch runs kPrefetchSteps steps ahead
// of the loads: without it the core did not keep enough reads in flight when the weights sat in a
// large L3 (from memory, the distance mattered little).
//
// Each output sums `in` in a fixed order (stretches of kStretch inputs, each in one lane, then the
// stretches in order): it depends neither on the other rows of x, nor on the blocking, nor on the
// thread count.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace pdserve {
bool use_avx512();  // gemv.cpp: AVX-512F here, and not capped by PDSERVE_CPU_ISA=avx2
}

namespace {

constexpr int kPanelVectors = 2;
constexpr int64_t kPrefetchSteps = 8;
// Inputs a stretch sums in one register before its sum joins the output's: one chain over all of
// `in` (1,536 for down) rounded worse than oneDNN against float64; in stretches the chains are
// 128 + in / 128 long, and the mean error fell below oneDNN's on down's shape.
constexpr int64_t kStretch = 128;

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace lanes16 {
constexpr int W = 16;
constexpr int kBlockRows = 14;  // 28 sums, the panel's 2 vectors and a broadcast: 31 of 32 registers
typedef float vf __attribute__((vector_size(W * 4)));
inline vf splat(float x) { return _mm512_set1_ps(x); }
#include "panel_matmul_lanes.h"
}  // namespace lanes16
#pragma GCC pop_options

namespace lanes8 {
constexpr int W = 8;
constexpr int kBlockRows = 6;  // 12 sums, 2 vectors and a broadcast: 15 of 16 registers
typedef float vf __attribute__((vector_size(W * 4)));
inline vf splat(float x) { return _mm256_set1_ps(x); }
#include "panel_matmul_lanes.h"
}  // namespace lanes8

int64_t panel_columns() { return kPanelVectors * (pdserve::use_avx512() ? 16 : 8); }

}  // namespace

// W [out, in] float32 -> panels [ceil(out / P)][in][P], the last panel's missing columns zero.
torch::Tensor pack_panels(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.device().is_cpu(),
              "pack_panels: a float32 CPU weight [out, in]");
  const int64_t out = w.size(0), in = w.size(1), p = panel_columns(), panels = (out + p - 1) / p;
  auto padded = torch::zeros({panels * p, in}, w.options());
  padded.narrow(0, 0, out).copy_(w);
  return padded.view({panels, p, in}).transpose(1, 2).contiguous();
}

// x [m, in] and panels from pack_panels (on this process's instruction set); out: W's row count.
torch::Tensor panel_matmul(const torch::Tensor& x, const torch::Tensor& panels, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && x.size(1) == panels.size(1),
              "panel_matmul: x [m, in] and panels [count, in, columns]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && panels.scalar_type() == torch::kFloat,
              "panel_matmul: float32 only");
  TORCH_CHECK(x.is_contiguous() && panels.is_contiguous() && x.device().is_cpu() && panels.device().is_cpu(),
              "panel_matmul: contiguous CPU tensors only");
  TORCH_CHECK(panels.size(2) == panel_columns(), "panel_matmul: panels of ", panels.size(2),
              " columns, but this CPU's are ", panel_columns(), ": pack them with pack_panels here");
  TORCH_CHECK(out > (panels.size(0) - 1) * panels.size(2) && out <= panels.size(0) * panels.size(2),
              "panel_matmul: ", panels.size(0), " panels cannot hold ", out, " columns");
  auto y = torch::empty({x.size(0), out}, x.options());
  if (pdserve::use_avx512())
    lanes16::matmul(x, panels, y);
  else
    lanes8::matmul(x, panels, y);
  return y;
}

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_matmul(Tensor x, Tensor panels, int out) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_matmul", &panel_matmul);
}
