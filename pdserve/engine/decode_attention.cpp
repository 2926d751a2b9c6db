// pdserve's paged decode attention: one query per sequence, over its K/V rows where they lie in the
// paged pool (pdserve/engine/cpu_kernels.py builds it; pdserve/engine/model.py calls it).
//
// The pool layer is cache[K|V, block, offset, kv_head, head_dim] float32, contiguous. Each sequence
// reads its rows through its block table, so nothing is gathered into a padded dense copy first:
// the rows are read once, where SDPA over a gathered copy reads them, writes the copy and reads it
// again. Work items are (sequence, KV head) pairs shared out to torch's intra-op threads; an item
// takes the query heads of its KV head (grouped-query attention) together, so each K and V row is
// read from memory once for all of them (the later heads find it in cache):
//
//     scores[h, t] = scale * q[h] . K[t]        first <= t < context_len, h in the KV head's query heads
//     p[h, t]      = exp(scores[h, t] - max_t scores[h, t]) / sum_t exp(...)
//     out[h]       = sum_t p[h, t] V[t]
//
// first is 0, or with a sliding window (Gemma 3's local layers, Mistral's), context_len - window: the
// query at position context_len - 1 sees its last `window` rows, itself included (transformers'
// sliding_window_overlay). The rows before them are not read at all, nor the blocks that hold them.
//
// A score keeps 8 partial sums (one AVX2 register), added in a fixed order whether its key was scored
// in a group of 8 or alone; the softmax's sum and the values' sums run in token order. So a result
// depends on its own sequence only: not on the thread count, the batch, or the other sequences.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

#include "cephes_exp.h"

namespace {

constexpr int64_t kTokens = 8;  // keys scored together, one accumulator each (independent FMA chains)
constexpr int64_t kChunk = 8;   // output registers per pass over the values: 64 floats of a head

// The horizontal sum in the order the 8-key reduction below adds (pairs, then quads, then halves),
// so a key's score is the same bits whether it was scored in a group of 8 or alone.
inline float horizontal_sum(__m256 v) {
  const __m256 pairs = _mm256_hadd_ps(v, v);
  const __m256 quads = _mm256_hadd_ps(pairs, pairs);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// The 8 accumulators' horizontal sums, as one vector (lane j: a[j]).
inline __m256 horizontal_sums(const __m256 (&a)[kTokens]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for x <= 0, 8 lanes (cephes_exp.h); underflows to 0 below -87.
inline __m256 exp_ps(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  return _mm256_andnot_ps(underflow, pdserve::exp8_in_range(_mm256_max_ps(x, low)));
}

constexpr int64_t kPrefetchAhead = 16;  // rows: the next block's, while this one is read

// Asks for a row's cache lines ahead of its use: the rows of a sequence lie in blocks scattered over
// the pool, which the hardware prefetcher cannot follow from one block to the next.
inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(row + i), _MM_HINT_T0);
}

struct Shape {
  int64_t heads, kv_heads, head_dim, block_size, blocks, table_width;
};

// Where one sequence's rows lie for one KV head: each key row's address, found once per item by
// walking the block table (no division per row), and the distance from a key row to its value row.
struct Rows {
  const Shape& s;
  const float* const* keys;  // [len]: the rows first .. context_len - 1, renumbered from 0
  int64_t value_offset;      // floats from the K plane to the V plane

  const float* key(int64_t t) const { return keys[t]; }
  const float* value(int64_t t) const { return keys[t] + value_offset; }
};

// keys[t - first] = K row t, for first <= t < end: from first's block on, the blocks before it unread.
void find_keys(const float* cache, const int64_t* table, int64_t first, int64_t end, int64_t kv_head,
               const Shape& s, std::vector<const float*>& keys) {
  keys.resize(end - first);
  const int64_t row_stride = s.kv_heads * s.head_dim;
  for (int64_t block = first / s.block_size, t = first; t < end; ++block) {
    const int64_t offset = t - block * s.block_size;
    const float* row = cache + (table[block] * s.block_size + offset) * row_stride + kv_head * s.head_dim;
    for (; t < std::min(end, (block + 1) * s.block_size); ++t, row += row_stride) keys[t - first] = row;
  }
}

// The first row a query at position len - 1 sees: 0, or the first of its last `window` rows.
inline int64_t first_visible(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// q . k over d values, 8 lanes then the fixed-order sum; the tail past the last whole vector last.
inline float dot(const float* q, const float* k, int64_t d) {
  const int64_t vector_end = d - d % 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < vector_end; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), _mm256_loadu_ps(q + i), acc);
  float tail = 0.0f;
  for (int64_t i = vector_end; i < d; ++i) tail += q[i] * k[i];
  return horizontal_sum(acc) + tail;
}

// scores[t] = scale * q . K[t] for t < len; 8 keys at a time, each in the order dot() sums.
void score(const float* q, const Rows& rows, int64_t len, float scale, float* scores) {
  const int64_t d = rows.s.head_dim, vector_end = d - d % 8;
  int64_t t = 0;
  for (; t + kTokens <= len; t += kTokens) {
    const float* k[kTokens];
    __m256 acc[kTokens];
    for (int64_t j = 0; j < kTokens; ++j) {
      k[j] = rows.key(t + j);
      acc[j] = _mm256_setzero_ps();
      if (t + kPrefetchAhead + j < len) prefetch_row(rows.key(t + kPrefetchAhead + j), d);
    }
    for (int64_t i = 0; i < vector_end; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int64_t j = 0; j < kTokens; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(k[j] + i), qv, acc[j]);
    }
    alignas(32) float tails[kTokens] = {};
    for (int64_t j = 0; j < kTokens; ++j)
      for (int64_t i = vector_end; i < d; ++i) tails[j] += q[i] * k[j][i];
    const __m256 dots = _mm256_add_ps(horizontal_sums(acc), _mm256_load_ps(tails));
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(_mm256_set1_ps(scale), dots));
  }
  for (; t < len; ++t) scores[t] = scale * dot(q, rows.key(t), d);
}

// scores[0..len) -> softmax probabilities in place; the buffer is padded to whole vectors.
void softmax(float* scores, int64_t len) {
  float top = scores[0];
  for (int64_t t = 1; t < len; ++t) top = std::max(top, scores[t]);
  const int64_t padded = (len + 7) / 8 * 8;
  std::fill(scores + len, scores + padded, top);  // exp(0) = 1 there, zeroed below
  const __m256 top_v = _mm256_set1_ps(top);
  for (int64_t t = 0; t < padded; t += 8)
    _mm256_storeu_ps(scores + t, exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + t), top_v)));
  std::fill(scores + len, scores + padded, 0.0f);
  float total = 0.0f;
  for (int64_t t = 0; t < len; ++t) total += scores[t];
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(scores + t, _mm256_mul_ps(_mm256_loadu_ps(scores + t), inverse));
}

// out[c, c + 8R) = sum_t p[t] V[t][c, c + 8R): R output registers held across every value row.
template <int64_t R>
void accumulate(const float* p, const Rows& rows, int64_t len, int64_t c, float* out) {
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    if (t + kPrefetchAhead < len) prefetch_row(rows.value(t + kPrefetchAhead) + c, 8 * R);
    const __m256 pv = _mm256_set1_ps(p[t]);
    const float* v = rows.value(t) + c;
    for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * r), acc[r]);
  }
  for (int64_t r = 0; r < R; ++r) _mm256_storeu_ps(out + c + 8 * r, acc[r]);
}

// out = sum_t p[t] V[t], head_dim values: chunks of 64, then of 8, then the scalar tail.
void weigh_values(const float* p, const Rows& rows, int64_t len, float* out) {
  const int64_t d = rows.s.head_dim;
  int64_t c = 0;
  for (; c + 8 * kChunk <= d; c += 8 * kChunk) accumulate<kChunk>(p, rows, len, c, out);
  for (; c + 8 <= d; c += 8) accumulate<1>(p, rows, len, c, out);
  for (; c < d; ++c) {
    float sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) sum += p[t] * rows.value(t)[c];
    out[c] = sum;
  }
}

// One (sequence, KV head) item: each of its query heads attends over len rows.
void attend(const float* q, const Rows& rows, int64_t len, float scale, float* out, std::vector<float>& scores) {
  const int64_t group = rows.s.heads / rows.s.kv_heads, d = rows.s.head_dim;
  scores.resize((len + 7) / 8 * 8);
  for (int64_t h = 0; h < group; ++h) {
    score(q + h * d, rows, len, scale, scores.data());
    softmax(scores.data(), len);
    weigh_values(scores.data(), rows, len, out + h * d);
  }
}

}  // namespace

// q [B, heads, head_dim]; cache [2, blocks, block_size, kv_heads, head_dim]; block_tables [B, width]
// (padded; only the entries of the blocks the window covers are read, up to ceil(len / block_size));
// context_lens [B] (0: a padded row, whose output is 0); window: the keys each query sees, its own
// included, or 0 for all of them.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be 0 (no limit) or more, not ", window);
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && block_tables.dim() == 2 && context_lens.dim() == 1,
              "paged_decode_attention: q [B, H, D], cache [2, blocks, block_size, KVH, D], "
              "block_tables [B, width], context_lens [B]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && cache.scalar_type() == torch::kFloat,
              "paged_decode_attention: a float32 query and a float32 cache only");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "paged_decode_attention: int64 block tables and context lengths");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && block_tables.is_contiguous() &&
              context_lens.is_contiguous(), "paged_decode_attention: contiguous tensors only");
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  const Shape s{q.size(1), cache.size(3), q.size(2), cache.size(2), cache.size(1), block_tables.size(1)};
  const int64_t batch = q.size(0);
  TORCH_CHECK(cache.size(0) == 2 && cache.size(4) == s.head_dim && s.heads % s.kv_heads == 0 &&
              block_tables.size(0) == batch && context_lens.size(0) == batch,
              "paged_decode_attention: shapes disagree");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= s.table_width * s.block_size,
                "paged_decode_attention: context length ", lens[b], " of row ", b, " is outside 0..",
                s.table_width * s.block_size);
    const int64_t blocks = (lens[b] + s.block_size - 1) / s.block_size;
    for (int64_t i = first_visible(lens[b], window) / s.block_size; i < blocks; ++i)
      TORCH_CHECK(tables[b * s.table_width + i] >= 0 && tables[b * s.table_width + i] < s.blocks,
                  "paged_decode_attention: block ", tables[b * s.table_width + i], " of row ", b,
                  " is outside the pool's ", s.blocks, " blocks");
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = s.heads / s.kv_heads, d = s.head_dim;
  const int64_t value_offset = s.blocks * s.block_size * s.kv_heads * d;
  at::parallel_for(0, batch * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> keys;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / s.kv_heads, g = item % s.kv_heads;
      const int64_t first = (b * s.heads + g * group) * d;
      if (lens[b] == 0) {  // a padded row of a static batch (static_decode.py): it sees nothing
        std::fill(op + first, op + first + group * d, 0.0f);
        continue;
      }
      const int64_t visible = first_visible(lens[b], window);
      find_keys(cp, tables + b * s.table_width, visible, lens[b], g, s, keys);
      const Rows rows{s, keys.data(), value_offset};
      attend(qp + first, rows, lens[b] - visible, static_cast<float>(scale), op + first, scores);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
