// pdserve's paged prefill attention: the queries of one prefill chunk (positions start .. start+T-1 of
// one sequence) over every K/V row of the sequence up to each query, causal, read where the rows lie
// in the paged pool (pdserve/engine/cpu_kernels.py builds it; pdserve/engine/model.py calls it under
// attention_kernel native).
//
// Why: torch's SDPA wants K/V as dense tensors, so a chunk after a cached prefix gathered the whole
// context from the pool, layer by layer, and attended with a boolean mask; and torch's flash SDPA
// ran well below the products' FLOP rate (bench.profile_engine). This kernel is a flash attention over
// the pool: key tiles of two vectors (32 keys on AVX-512, 16 on AVX2), transposed once per call and
// shared by every query head of their KV head and by 12 query rows at a time (6 on AVX2), an online
// softmax, and the values read from the pool. The body (prefill_attention_lanes.h) is compiled for
// both widths; the AVX-512 one runs where the CPU has it, unless PDSERVE_CPU_ISA=avx2 (as the GEMV).
//
// A chunk of few query rows a KV head (up to kLaneRowsMax: a short suffix after a long cached
// prefix) takes the lanes path instead: its rows in a vector's lanes and each key read in place, with
// no transposed copy, which for a few rows cost more than their arithmetic (the lanes header's
// second half).
//
// A row's sums run over key tiles that start at multiples of the tile from key 0, in the same order
// on both paths, so a row gets the same bits whichever chunk it is in, whatever the thread count.
//
// With a sliding window (Gemma 3's local layers, Mistral's) the query at position i sees the keys j
// with i - window < j <= i, its own and the window - 1 before it (transformers'
// sliding_window_overlay). A work item starts at the key tile that holds its first row's first key,
// the keys of that tile before it masked and never read (nor the blocks before it), and a row's tiles
// before its own window add exactly nothing to its sums (the lanes header's online softmax), so the
// bits stay those of any chunk and either path.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace pdserve {
bool use_avx512();  // gemv.cpp: AVX-512F here, and not capped by PDSERVE_CPU_ISA=avx2
}

namespace {

// Query rows a KV head up to which the lanes path runs: SmolLM2's 128 queries (3 rows each). After
// a long cached prefix the lanes path led from 1 to 128 queries and by less at 256, and a fresh
// 128-query chunk tied (python -m bench.attention_kernels --only paths; docs/benchmarks.md). Past 384
// rows the tiled path runs: the lanes path was not timed on longer chunks.
constexpr int64_t kLaneRowsMax = 384;

// One call's shapes and where its rows are: the pool layer is cache[K|V, block, offset, kv_head, d].
struct Problem {
  const float* q;  // [tokens, heads, head_dim]
  const float* cache;
  // NOTE: each position's slot (block * block_size + offset), worked out once per call: the value
  // rows of every key tile are looked up again by every item, and a division per key cost more there
  // than the tile's arithmetic.
  const int64_t* slots;  // [context]
  int64_t tokens, heads, kv_heads, head_dim, start, context, value_offset;
  float scale;
  int64_t window;  // keys a query sees, its own included; 0 for every key up to it

  // the first key a query at this position sees
  int64_t first_key(int64_t position) const {
    return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
  }

  const float* key(int64_t t, int64_t kv_head) const {
    return cache + (slots[t] * kv_heads + kv_head) * head_dim;
  }
  const float* value(int64_t t, int64_t kv_head) const { return key(t, kv_head) + value_offset; }
};

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace lanes16 {
constexpr int W = 16;
constexpr int TV = 2;      // 32 keys a tile
constexpr int kRows = 12;  // 24 score registers and the key tile's 2: 26 of 32
constexpr int RP = 6;      // 6 rows x 4 vectors of output + 4 of values: 28 of 32 registers
constexpr int RPL = 4;     // the lanes path's rows, 4 at a time: 16 + 4 + a broadcast
constexpr int LV = 3;      // the lanes path's vectors of rows an item: 3 x 8 sums, 3 queries, a broadcast
                           // (14 queries of SmolLM2 in one item a KV head: its K/V read once)
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
inline vf splat(float x) { return _mm512_set1_ps(x); }
inline vi splat_int(int32_t x) { return (vi)_mm512_set1_epi32(x); }
// W rows' vectors in, one lane a row out, in order (the header's row_sums, row_maxes): four rounds that
// each pair lanes i and i + h of every row, h = 8, 4, 2, 1, two rows a shuffle.
template <typename Op>
inline vf across_rows(const vf* v, Op op) {
  __m512 half[8], quarter[4], eighth[2];
  for (int k = 0; k < 8; ++k)
    half[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                 _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)
    quarter[k] = op(_mm512_shuffle_f32x4(half[2 * k], half[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_f32x4(half[2 * k], half[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)
    eighth[k] = op(_mm512_shuffle_ps(quarter[2 * k], quarter[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_shuffle_ps(quarter[2 * k], quarter[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 rows = op(_mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(eighth[0], eighth[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), rows);
}
inline vf row_sums(const vf* v) { return across_rows(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); }); }
inline vf row_maxes(const vf* v) { return across_rows(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }); }
#include "prefill_attention_lanes.h"
}  // namespace lanes16
#pragma GCC pop_options

namespace lanes8 {
constexpr int W = 8;
constexpr int TV = 2;      // 16 keys a tile
constexpr int kRows = 6;   // 12 score registers and the key tile's 2: 14 of 16
constexpr int RP = 2;      // 2 rows x 4 vectors of output + 4 of values: 12 of 16 registers
constexpr int RPL = 2;     // the lanes path's rows, 2 at a time
constexpr int LV = 1;      // one vector of rows an item: 8 sums, the queries and a broadcast, of 16
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
inline vf splat(float x) { return _mm256_set1_ps(x); }
inline vi splat_int(int32_t x) { return (vi)_mm256_set1_epi32(x); }
// As lanes16's, in three rounds: h = 4, 2, 1.
template <typename Op>
inline vf across_rows(const vf* v, Op op) {
  __m256 half[4], quarter[2];
  for (int k = 0; k < 4; ++k)
    half[k] = op(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                 _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
  for (int k = 0; k < 2; ++k)
    quarter[k] = op(_mm256_shuffle_ps(half[2 * k], half[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm256_shuffle_ps(half[2 * k], half[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 rows = op(_mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(rows, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline vf row_sums(const vf* v) { return across_rows(v, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); }); }
inline vf row_maxes(const vf* v) { return across_rows(v, [](__m256 a, __m256 b) { return _mm256_max_ps(a, b); }); }
#include "prefill_attention_lanes.h"
}  // namespace lanes8

}  // namespace

// q [T, heads, head_dim] (the chunk's queries, rotated); cache [2, blocks, block_size, kv_heads,
// head_dim], the chunk's own rows written already; block_table [width] (the sequence's, covering
// start + T rows; the entries before the blocks the first query's window covers are not read); start:
// the chunk's first position; window: the keys each query sees, its own included, or 0 for all.
// path: "lanes", "tiled", or "auto" (lanes up to kLaneRowsMax query rows a KV head).
torch::Tensor attend_on(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& block_table,
                        int64_t start, double scale, int64_t window, const std::string& path) {
  TORCH_CHECK(path == "auto" || path == "lanes" || path == "tiled",
              "paged_prefill_attention: path must be auto, lanes or tiled, not ", path);
  TORCH_CHECK(window >= 0, "paged_prefill_attention: window must be 0 (no limit) or more, not ", window);
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && block_table.dim() == 1,
              "paged_prefill_attention: q [T, H, D], cache [2, blocks, block_size, KVH, D], block_table [width]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && cache.scalar_type() == torch::kFloat &&
              block_table.scalar_type() == torch::kLong,
              "paged_prefill_attention: a float32 query and cache, an int64 block table");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && block_table.is_contiguous() && q.device().is_cpu() &&
              cache.device().is_cpu(), "paged_prefill_attention: contiguous CPU tensors only");
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = cache.size(3);
  const int64_t block_size = cache.size(2), blocks = cache.size(1), context = start + tokens;
  TORCH_CHECK(cache.size(0) == 2 && cache.size(4) == head_dim && kv_heads > 0 && heads % kv_heads == 0,
              "paged_prefill_attention: shapes disagree");
  TORCH_CHECK(tokens >= 1 && start >= 0 && context <= block_table.size(0) * block_size,
              "paged_prefill_attention: ", tokens, " queries from position ", start, " need ", context,
              " rows; the block table holds ", block_table.size(0) * block_size);
  TORCH_CHECK(context < (int64_t{1} << 31), "paged_prefill_attention: positions must fit in 31 bits");
  const int64_t* table = block_table.data_ptr<int64_t>();
  // NOTE: a window as long as the context limits nothing: 0 then, so that position - window fits in 32 bits.
  const int64_t limit = window < context ? window : 0;
  const int64_t first_key = limit > 0 ? std::max<int64_t>(0, start - limit + 1) : 0;  // no row before it is read
  for (int64_t i = first_key / block_size; i < (context + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < blocks, "paged_prefill_attention: block ", table[i],
                " is outside the pool's ", blocks, " blocks");
  std::vector<int64_t> slots(static_cast<size_t>(context));
  for (int64_t t = first_key; t < context; ++t) slots[t] = table[t / block_size] * block_size + t % block_size;
  auto out = torch::empty_like(q);
  const Problem p{q.data_ptr<float>(), cache.data_ptr<float>(), slots.data(), tokens, heads, kv_heads, head_dim,
                  start, context, blocks * block_size * kv_heads * head_dim, static_cast<float>(scale), limit};
  const bool lanes = path == "lanes" || (path == "auto" && tokens * (heads / kv_heads) <= kLaneRowsMax);
  if (pdserve::use_avx512())
    lanes ? lanes16::attend_lanes(p, out.data_ptr<float>()) : lanes16::attend(p, out.data_ptr<float>());
  else
    lanes ? lanes8::attend_lanes(p, out.data_ptr<float>()) : lanes8::attend(p, out.data_ptr<float>());
  return out;
}

torch::Tensor paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& cache,
                                      const torch::Tensor& block_table, int64_t start, double scale,
                                      int64_t window) {
  return attend_on(q, cache, block_table, start, scale, window, "auto");
}

// The same attention on the path named: the tests check that both give the same bits, and
// bench.attention_kernels times one against the other.
torch::Tensor paged_prefill_attention_on(const torch::Tensor& q, const torch::Tensor& cache,
                                         const torch::Tensor& block_table, int64_t start, double scale,
                                         const std::string& path, int64_t window) {
  return attend_on(q, cache, block_table, start, scale, window, path);
}

int64_t prefill_attention_lane_rows() { return kLaneRowsMax; }

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  // the query rows a KV head up to which a chunk takes the lanes path
  m.def("prefill_attention_lane_rows() -> int", &prefill_attention_lane_rows);
  m.def("paged_prefill_attention(Tensor q, Tensor cache, Tensor block_table, int start, float scale, "
        "int window=0) -> Tensor");
  m.def("paged_prefill_attention_on(Tensor q, Tensor cache, Tensor block_table, int start, float scale, "
        "str path, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("paged_prefill_attention_on", &paged_prefill_attention_on);
}
