// pdserve's fused pointwise ops: the element-by-element work between a layer's products, one pass
// over the rows each instead of torch's five to eight (pdserve/engine/pointwise.py calls them under
// pointwise_kernel native).
//
//   rms_norm(x, w, eps)             -> w * (x / sqrt(mean(x^2) + eps)), row by row
//   add_rms_norm_(x, res, w, eps)      res += x, then x = rms_norm(res): the residual add of a
//                                      sublayer and the next sublayer's norm, both in place
//   silu_and_mul(gate_up)           -> silu(gate) * up, gate_up [T, 2I] as the fused product gives it
//   rotary_(qkv, cos, sin, heads)      rotate-half RoPE of the first `heads` heads of each row, in place
//
// Why: in a long cold prefill torch's elementwise ops are a sizeable share of the op time (python -m
// bench.profile_engine): mul, add, silu, pow, mean, cat and neg each read and write arrays of
// megabytes. At batch 1 they are some 20 op calls a layer. vLLM's CPU build runs fused
// kernels of the same four (its fused_add_rms_norm, silu_and_mul and rotary_embedding).
//
// Exactness: rotary_ and the residual sum are bit-equal to torch's ops (a product, a product, a sum,
// each rounded; fp-contract is off in this file so no FMA merges them). The norm's sum of squares
// runs in its own order (8 lanes, then across), and silu's exp is a Cephes polynomial within about
// 1 ulp of expf, so those two differ from torch's by a few ulp (tests/engine/test_pointwise.py).

#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>

#include "cephes_exp.h"

namespace {

constexpr int64_t kNormGrainRows = 32;  // rows of 576 floats: under this a call runs on one thread
constexpr int64_t kSiluGrainRows = 8;

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline float sum_of_squares(const float* x, int64_t n) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    even = _mm256_fmadd_ps(a, a, even);
    odd = _mm256_fmadd_ps(b, b, odd);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i);
    even = _mm256_fmadd_ps(a, a, even);
  }
  float sum = horizontal_sum(_mm256_add_ps(even, odd));
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// out = w * (x * r), the order torch's `weight * (x * torch.rsqrt(variance + eps))` rounds in.
inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

inline float inverse_rms(const float* x, int64_t n, float eps) {
  const float variance = sum_of_squares(x, n) / static_cast<float>(n);
  return 1.0f / std::sqrt(variance + eps);
}

inline void add_into(float* residual, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(residual + i, _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(x + i)));
  for (; i < n; ++i) residual[i] = residual[i] + x[i];
}

// e^x for 8 lanes (cephes_exp.h) over [-87, 88.38], 0 below and infinity above. silu divides by
// 1 + e^-x, so at either end it rounds as torch's does: x itself far above 0, a zero far below
// (tests/engine/test_pointwise.py).
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f), high = _mm256_set1_ps(88.3762626647949f);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ), overflow = _mm256_cmp_ps(x, high, _CMP_GT_OQ);
  const __m256 e = pdserve::exp8_in_range(_mm256_min_ps(_mm256_max_ps(x, low), high));
  return _mm256_blendv_ps(_mm256_andnot_ps(underflow, e), _mm256_set1_ps(INFINITY), overflow);
}

// silu(g) * u = g / (1 + e^-g) * u, as torch's silu then mul round it.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// One head, rotate-half: first = x1 cos - x2 sin, second = x2 cos + x1 sin, each product rounded
// before the sum as torch's x * cos + cat(-x2, x1) * sin rounds it.
inline void rotate_head(float* x, const float* cos, const float* sin, int64_t half) {
  float* second = x + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(second + i);
    const __m256 neg_x2 = _mm256_sub_ps(_mm256_setzero_ps(), x2);
    const __m256 first_out = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(cos + i)),
                                           _mm256_mul_ps(neg_x2, _mm256_loadu_ps(sin + i)));
    const __m256 second_out = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(cos + half + i)),
                                            _mm256_mul_ps(x1, _mm256_loadu_ps(sin + half + i)));
    _mm256_storeu_ps(x + i, first_out);
    _mm256_storeu_ps(second + i, second_out);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = second[i];
    x[i] = x1 * cos[i] + (-x2) * sin[i];
    second[i] = x2 * cos[half + i] + x1 * sin[half + i];
  }
}

void check_rows(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              op, ": a float32 CPU tensor [rows, width] with contiguous rows");
}

void check_weight(const torch::Tensor& x, const torch::Tensor& w, const char* op) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == torch::kFloat,
              op, ": weight [", x.size(1), "] float32");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  check_weight(x, w, "rms_norm");
  const int64_t n = x.size(1), in_stride = x.stride(0);
  auto out = torch::empty({x.size(0), n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), kNormGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * in_stride;
      scale_row(row, wp, inverse_rms(row, n, static_cast<float>(eps)), op + t * n, n);
    }
  });
  return out;
}

void add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w, double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  check_weight(x, w, "add_rms_norm_");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm_: residual ", residual.sizes(), " and x ", x.sizes());
  const int64_t n = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, x.size(0), kNormGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* res = rp + t * r_stride;
      add_into(res, xp + t * x_stride, n);
      scale_row(res, wp, inverse_rms(res, n, static_cast<float>(eps)), xp + t * x_stride, n);
    }
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up's width ", gate_up.size(1), " is odd");
  const int64_t n = gate_up.size(1) / 2, in_stride = gate_up.stride(0);
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, gate_up.size(0), kSiluGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * in_stride, gp + t * in_stride + n, op + t * n, n);
  });
  return out;
}

// qkv [T, width] (rows contiguous); cos and sin [T, head_dim] (any leading shape of T rows, contiguous).
void rotary_(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
             int64_t head_dim) {
  check_rows(qkv, "rotary_");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && heads >= 1 && heads * head_dim <= qkv.size(1),
              "rotary_: ", heads, " heads of ", head_dim, " do not fit rows of ", qkv.size(1));
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->numel() == tokens * head_dim && table->is_contiguous() &&
                table->scalar_type() == torch::kFloat, "rotary_: cos and sin [", tokens, ", ", head_dim, "] float32");
  float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  at::parallel_for(0, tokens, kNormGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        rotate_head(xp + t * stride + h * head_dim, cp + t * head_dim, sp + t * head_dim, head_dim / 2);
  });
}

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor w, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
}
