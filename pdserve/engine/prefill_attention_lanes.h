// The body of pdserve's paged prefill attention for one vector width: prefill_attention.cpp includes
// it twice, in namespace lanes16 under `#pragma GCC target("avx512f")` and in namespace lanes8 under
// the file's -mavx2 -mfma, each after defining
//
//     W            lanes of a vector
//     TV           vectors of keys in a key tile (TV * W keys), scored in TV registers per row
//     kRows        query rows of a work item, TV score registers each
//     RP           rows whose output registers one pass over a tile's values keeps (PV below)
//     vf, vi       GCC vectors of W floats and W int32s
//     splat(float), splat_int(int32_t)   a value in every lane (an intrinsic: `vf{} + x` costs an add)
//     row_sums(v), row_maxes(v)   for W vectors v[0..W), one a row: a vector whose lane r is the sum
//                  (the maximum) of v[r]'s lanes. A sum runs as a tree, lanes i and i + W/2 added
//                  first, then i and i + W/4, and so on down to the last pair; the lanes path
//                  re-creates that order for its rows (tile_sum below)
//
// The rest is written in GCC's vector extensions, not intrinsics, so the one text compiles to either
// width.
//
// One work item is a KV head and up to kRows query rows of it: (query i, head h) pairs of that KV
// head's query heads, in order, so an item shares each key tile among every head of its group and
// several queries. Per key tile of T = TV * W keys (tiles start at multiples of T from key 0,
// whatever the chunk, so a row's sums run in the same order on every path: a fresh prefill, a prefix
// hit, the audit's recompute):
//
//     QK   s[r] = scale * sum_d q[r][d] * Kt[d]     Kt: the tile's keys transposed, TV vectors per d
//     mask s[r][j] = -inf where key j comes after row r's position (causal), or before its window
//     soft m' = max(m, max_j s), p = exp(s - b), l = l * exp(m - b) + sum_j p     (online softmax)
//     PV   o[r] = o[r] * exp(m - b) + sum_j p[r][j] * V[j]
//
// and at the end out[r] = o[r] / l[r]; b is m', or 0 while m' is -inf: a row whose window starts past
// the tile has seen no key yet, and keeps p = 0, l = 0, o = 0 (where m - m' would be -inf + inf).
// So a tile before a row's window adds exactly nothing, and the row's sums are those of its own first
// tile on: the same in any item. An item's tiles start at the one that holds its first row's first
// key (key 0 without a window); the keys before that key are never read, nor their values weighed.

constexpr int T = TV * W;  // keys of a key tile
constexpr int kRowsPadded = (kRows + W - 1) / W * W;  // per-row scalars, as whole vectors
constexpr int kChunk = 4;  // output registers a row keeps per pass over the values (64 floats at W=16)

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf as_float(vi v) {
  vf f;
  __builtin_memcpy(&f, &v, sizeof f);
  return f;
}
inline vi as_int(vf v) {
  vi i;
  __builtin_memcpy(&i, &v, sizeof i);
  return i;
}

// exp(x) for x <= 0 or -inf: Cephes' expf, as the decode kernel's exp_ps (range reduction by ln 2,
// rounded to nearest, a degree-5 polynomial); 0 below -87.
inline vf exp_negative(vf x) {
  const vi underflow = x < splat(-87.0f);
  x = underflow ? splat(-87.0f) : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  x = x - n * 0.693359375f;
  x = x - n * -2.12194440e-4f;
  vf y = splat(1.9875691500e-4f);
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + (x + 1.0f);
  const vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;
  return as_float(as_int(y * as_float(exponent)) & ~underflow);
}

// The first key of the key tile that holds a key.
inline int64_t tile_of(int64_t key) { return key / T * T; }

// W keys transposed: kt[d * W + j] = K[key0 + j][d]; zeros before the chunk's first key (the first
// query's window: not read) and past the last key.
inline void transpose_tile(const Problem& p, int64_t kv_head, int64_t key0, float* kt) {
  const int64_t first = std::clamp<int64_t>(p.first_key(p.start) - key0, 0, W);
  const int64_t end = std::clamp<int64_t>(p.context - key0, first, W);
  for (int64_t j = 0; j < W; ++j) {
    if (j < first || j >= end) {
      for (int64_t d = 0; d < p.head_dim; ++d) kt[d * W + j] = 0.0f;
      continue;
    }
    const float* row = p.key(key0 + j, kv_head);
    for (int64_t d = 0; d < p.head_dim; ++d) kt[d * W + j] = row[d];
  }
}

// Every KV head's keys, W at a time, from the key tile of the chunk's first key, transposed once per
// call and shared by every item (kts: [KVH][tiles][D][W], tiles a whole number of key tiles: a key
// tile is TV of them in a row).
inline int64_t first_transposed_key(const Problem& p) { return tile_of(p.first_key(p.start)); }
inline int64_t transposed_tiles(const Problem& p) {
  return (p.context - first_transposed_key(p) + T - 1) / T * TV;
}

inline void transpose_keys(const Problem& p, float* kts) {
  const int64_t tiles = transposed_tiles(p), tile_floats = p.head_dim * W, first = first_transposed_key(p);
  at::parallel_for(0, p.kv_heads * tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item)
      transpose_tile(p, item / tiles, first + (item % tiles) * W, kts + item * tile_floats);
  });
}

struct Item {
  const float* q[kRows];  // each row's query (a padding row repeats the last real one)
  float* q_by_dim;        // the rows' queries transposed: [head_dim][kRows], one base for every broadcast
  int32_t position[kRows];
  int32_t first_key[kRows];  // of each row's window: 0 without one
  int64_t real_rows;
  int32_t last_position;
};

// s[r][t] = scale * q[r] . K[key0 + t * W + j], j < W, from the TV transposed W-key blocks at kt.
inline void score_tile(const Item& item, const float* kt, int64_t head_dim, float scale, vf (&s)[kRows][TV]) {
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < TV; ++t) s[r][t] = vf{};
  const float* q = item.q_by_dim;
  const int64_t block = head_dim * W;
  for (int64_t d = 0; d < head_dim; ++d, q += kRows) {
    vf k[TV];
#pragma GCC unroll 2
    for (int t = 0; t < TV; ++t) k[t] = load(kt + t * block + d * W);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const vf qr = splat(q[r]);
#pragma GCC unroll 2
      for (int t = 0; t < TV; ++t) s[r][t] += qr * k[t];
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < TV; ++t) s[r][t] *= scale;
}

// -inf where a key comes after the row's position or before its window.
inline void mask_tile(const Item& item, int64_t key0, vf (&s)[kRows][TV]) {
  const vf minus_infinity = splat(-__builtin_inff());
#pragma GCC unroll 2
  for (int t = 0; t < TV; ++t) {
    vi keys;
    for (int j = 0; j < W; ++j) keys[j] = static_cast<int32_t>(key0 + t * W + j);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const vi hidden = (keys > splat_int(item.position[r])) | (keys < splat_int(item.first_key[r]));
      s[r][t] = hidden ? minus_infinity : s[r][t];
    }
  }
}

// The online softmax's base: the running maximum, or 0 where no key has been seen (-inf).
inline vf softmax_base(vf top) { return top == splat(-__builtin_inff()) ? vf{} : top; }

// o[r][c, c + CC*W) = o * rescale[r] + sum_j p[r][j] V[key0 + j][c, ...), for Rows rows, RP at a time;
// the probabilities lie at probs[r * RS + j * KS] (RS = T, KS = 1 for the tiled path's items; RS = 1,
// KS = W for the lanes path's, whose rows run across a vector's lanes).
template <int Rows, int RP, int RS, int KS, int CC>
inline void weigh_values(const Problem& p, const float* const* values, int64_t keys, const float* probs,
                         const float* rescale, int64_t c, float* o) {
  static_assert(Rows % RP == 0, "a pass over the values covers RP rows");
  const int64_t d = p.head_dim;
  for (int r0 = 0; r0 < Rows; r0 += RP) {
    vf acc[RP][CC];
#pragma GCC unroll 8
    for (int r = 0; r < RP; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < CC; ++k) acc[r][k] = load(o + (r0 + r) * d + c + k * W) * rescale[r0 + r];
    for (int64_t j = 0; j < keys; ++j) {
      // NOTE: one pointer each for the value row and the weights, constant offsets from them: with
      // an address per row GCC ran out of registers and reloaded them from the stack every key.
      const float* value = values[j] + c;
      const float* weights = probs + r0 * RS + j * KS;
      vf v[CC];
#pragma GCC unroll 4
      for (int k = 0; k < CC; ++k) v[k] = load(value + k * W);
#pragma GCC unroll 8
      for (int r = 0; r < RP; ++r) {
        const vf weight = splat(weights[r * RS]);
#pragma GCC unroll 4
        for (int k = 0; k < CC; ++k) acc[r][k] += weight * v[k];
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RP; ++r)
#pragma GCC unroll 4
      for (int k = 0; k < CC; ++k) store(o + (r0 + r) * d + c + k * W, acc[r][k]);
  }
}

// The values' part of a tile, over the head's columns: chunks of kChunk vectors, then single vectors,
// then the scalar columns past the last whole vector.
template <int Rows, int RP, int RS, int KS>
inline void weigh_tile(const Problem& p, const float* const* values, int64_t keys, const float* probs,
                       const float* rescale, float* o) {
  const int64_t d = p.head_dim;
  int64_t c = 0;
  for (; c + kChunk * W <= d; c += kChunk * W)
    weigh_values<Rows, RP, RS, KS, kChunk>(p, values, keys, probs, rescale, c, o);
  for (; c + W <= d; c += W) weigh_values<Rows, RP, RS, KS, 1>(p, values, keys, probs, rescale, c, o);
  for (; c < d; ++c)
    for (int r = 0; r < Rows; ++r) {
      float sum = o[r * d + c] * rescale[r];
      for (int64_t j = 0; j < keys; ++j) sum += probs[r * RS + j * KS] * values[j][c];
      o[r * d + c] = sum;
    }
}

inline void write_rows(const Problem& p, const float* const* q, int64_t real_rows, const float* o,
                       const float* total, float* out) {
  const int64_t d = p.head_dim;
  for (int64_t r = 0; r < real_rows; ++r) {
    float* row = out + (q[r] - p.q);  // out has q's layout
    const float inverse = 1.0f / total[r];
    for (int64_t c = 0; c < d; ++c) row[c] = o[r * d + c] * inverse;
  }
}

// One item over every key tile its rows may see; o: kRows * head_dim floats of scratch.
inline void attend_item(const Problem& p, const Item& item, int64_t kv_head, const float* kts, float* o,
                        float* out) {
  const int64_t d = p.head_dim, tiles = transposed_tiles(p);
  alignas(64) float top[kRowsPadded], total[kRowsPadded], rescale[kRowsPadded], next[kRowsPadded];
  alignas(64) float sums[kRowsPadded], base[kRowsPadded];
  alignas(64) float probs[kRows * T];
  const float* values[T];
  for (int r = 0; r < kRowsPadded; ++r) top[r] = r < kRows ? -__builtin_inff() : 0.0f, total[r] = sums[r] = next[r] = 0.0f;
  std::fill(o, o + kRows * d, 0.0f);
  const int32_t first_position = item.position[0], first_key = item.first_key[0];
  const int32_t last_first_key = item.first_key[kRows - 1];
  const int64_t transposed_from = first_transposed_key(p);
  for (int64_t key0 = tile_of(first_key); key0 <= item.last_position; key0 += T) {
    vf s[kRows][TV];
    score_tile(item, kts + (kv_head * tiles + (key0 - transposed_from) / W) * d * W, d, p.scale, s);
    if (key0 + T - 1 > first_position || key0 < last_first_key) mask_tile(item, key0, s);
    vf lanes[kRowsPadded];  // per row: the maxima over its tile's keys, then the probabilities' sums
    for (int r = 0; r < kRowsPadded; ++r) {
      lanes[r] = r < kRows ? s[r][0] : vf{};  // a padding row's maximum stays 0, as its top
#pragma GCC unroll 2
      for (int t = 1; t < TV && r < kRows; ++t) lanes[r] = lanes[r] > s[r][t] ? lanes[r] : s[r][t];
    }
    for (int r = 0; r < kRowsPadded; r += W) {
      const vf tile_top = row_maxes(lanes + r), running = load(top + r);
      const vf top_now = running < tile_top ? tile_top : running;
      store(next + r, top_now);
      store(base + r, softmax_base(top_now));
    }
    for (int r = 0; r < kRows; ++r) {
      lanes[r] = vf{};
#pragma GCC unroll 2
      for (int t = 0; t < TV; ++t) {
        const vf probability = exp_negative(s[r][t] - base[r]);
        lanes[r] += probability;
        store(probs + r * T + t * W, probability);
      }
    }
    for (int r = 0; r < kRowsPadded; r += W) store(sums + r, row_sums(lanes + r));
    for (int r = 0; r < kRowsPadded; r += W) {  // 0 on a row's first tile, where top is -inf
      const vf rescaled = exp_negative(load(top + r) - load(base + r));
      store(rescale + r, rescaled);
      store(total + r, load(total + r) * rescaled + load(sums + r));
      store(top + r, load(next + r));
    }
    // the keys before the item's first are weighed by 0 for every row: skipped, their values unread
    const int64_t skip = std::max<int64_t>(0, first_key - key0);
    const int64_t keys = std::min<int64_t>(T, item.last_position + 1 - key0);
    for (int64_t j = skip; j < keys; ++j) values[j] = p.value(key0 + j, kv_head);
    weigh_tile<kRows, RP, T, 1>(p, values + skip, keys - skip, probs + skip, rescale, o);
  }
  write_rows(p, item.q, item.real_rows, o, total, out);
}

// The rows of item k: KV heads outer, so that the items running together read one head's keys and
// values (for 2,048 tokens, 0.5 + 0.5 MB of a head against 3 MB for all three of SmolLM2's, with
// 2 MB of L2 a core); within a head, from the last rows (the most keys) to the first.
inline int64_t item_kv_head(int64_t k, int64_t items_per_head) { return k / items_per_head; }

inline Item item_rows(const Problem& p, int64_t k, int64_t row_tiles, float* q_by_dim) {
  const int64_t group = p.heads / p.kv_heads, kv_head = item_kv_head(k, row_tiles);
  const int64_t first = (row_tiles - 1 - k % row_tiles) * kRows, rows = p.tokens * group;
  Item item{};
  item.real_rows = std::min<int64_t>(kRows, rows - first);
  item.q_by_dim = q_by_dim;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = first + std::min(r, item.real_rows - 1), i = row / group, h = kv_head * group + row % group;
    item.q[r] = p.q + (i * p.heads + h) * p.head_dim;
    item.position[r] = static_cast<int32_t>(p.start + i);
    item.first_key[r] = static_cast<int32_t>(p.first_key(p.start + i));
    for (int64_t d = 0; d < p.head_dim; ++d) q_by_dim[d * kRows + r] = item.q[r][d];
  }
  item.last_position = item.position[kRows - 1];
  return item;
}

// ---- The lanes path: a chunk of few rows, each key read where it lies ----
//
// For a short chunk after a long context, transposing every key (transpose_keys) cost more than the
// chunk's own arithmetic: 14 queries after 1,920 cached rows spent 0.21 of their 0.91 ms a layer
// on it (SmolLM2, 2 threads; a one-off build that stopped after the transposition), and the tiled
// items that followed read the keys a second time from the copy. Up to kLaneRowsMax query rows a KV
// head, an item is instead LV vectors of W rows in the lanes ((query i, head h) pairs as item_rows
// orders them: up to 3 x 16 on AVX-512, 1 x 8 on AVX2),
// scored against each key by broadcasting the key's elements from its row in the pool:
//
//     s[v][j] (a vector over rows) = scale * sum_d q_by_dim[d][v] * K[key0 + j][d]
//
// The same products, summed in the same order, and the same softmax as the tiled path's, per row:
// the tile's probability sum below re-creates row_sums' order (the vector's halves added, then their
// halves, down to one lane), so a row gets the same bits on either path, and which path a chunk
// takes never shows in its output (tests/engine/test_attention_kernels.py checks it bit for bit).
// python -m bench.attention_kernels --only paths times the two: a few queries after a long cached
// prefix run faster on this path.

constexpr int kKeysAtOnce = 8;  // keys scored together: 8 sums a vector of rows, the queries and a broadcast

// An item: 1 to LV vectors of W rows each, one KV head's.
struct LaneItem {
  const float* q[LV * W];  // each row's query (a padding row repeats the last real one)
  float* q_by_dim;         // [head_dim][vectors * W]: dimension d of every row's query
  vi position[LV];
  vi first_key[LV];  // of each row's window: 0 without one
  int64_t real_rows;
  int vectors;
  int32_t first_position, last_position;
  int32_t item_first_key, last_first_key;  // the first row's first key, and the last row's
};

// s[v][j] = scale * q . K[key0 + j] for the tile's T keys and the item's V vectors of rows (a key
// past the item's last row scores that row's key, one before the item's first key that key: masked
// below, as every key past a row's position or before its window is). Each key element is broadcast
// once and serves every vector.
template <int V>
inline void score_lanes(const Problem& p, const LaneItem& item, int64_t kv_head, int64_t key0, vf (*s)[T]) {
  for (int j0 = 0; j0 < T; j0 += kKeysAtOnce) {
    const float* key[kKeysAtOnce];
    vf sum[V][kKeysAtOnce];
#pragma GCC unroll 8
    for (int j = 0; j < kKeysAtOnce; ++j) {
      key[j] = p.key(std::clamp<int64_t>(key0 + j0 + j, item.item_first_key, item.last_position), kv_head);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) sum[v][j] = vf{};
    }
    // NOTE: the next tile's rows of these keys, K and V, asked for into L2, one cache line a
    // dimension: a row lies wherever its block does, and the hardware's prefetchers, which follow
    // strides, lose it at every block. Asked for all at once at the tile's start (a loop of 256 on
    // SmolLM2), the requests filled the core's line fill buffers and the loop stalled: a quarter of
    // the lanes path's samples under `perf record`; spread out like this, a few queries after a long
    // prefix ran faster (one-off A/B builds).
    const char* ahead[2 * kKeysAtOnce];
    for (int j = 0; j < kKeysAtOnce; ++j) {
      const int64_t t = std::min<int64_t>(key0 + T + j0 + j, item.last_position);
      ahead[2 * j] = reinterpret_cast<const char*>(p.key(t, kv_head));
      ahead[2 * j + 1] = reinterpret_cast<const char*>(p.value(t, kv_head));
    }
    const int64_t lines_per_row = p.head_dim / 16;  // a row's whole 64-byte lines: head_dim lines in all
    int64_t row = 0, line = 0;
    const float* q = item.q_by_dim;
    for (int64_t d = 0; d < p.head_dim; ++d, q += V * W) {
      if (lines_per_row > 0 && row < 2 * kKeysAtOnce) {
        _mm_prefetch(ahead[row] + line * 64, _MM_HINT_T1);
        if (++line == lines_per_row) line = 0, ++row;
      }
      vf qd[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) qd[v] = load(q + v * W);
#pragma GCC unroll 8
      for (int j = 0; j < kKeysAtOnce; ++j) {
        const vf k = splat(key[j][d]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) sum[v][j] += qd[v] * k;
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
#pragma GCC unroll 8
      for (int j = 0; j < kKeysAtOnce; ++j) s[v][j0 + j] = sum[v][j] * p.scale;
  }
}

// Each row's sum of a tile's probabilities, in row_sums' order for the tiled path's row: the TV
// vectors of a row added lane by lane, then the lanes folded in halves down to one.
inline vf tile_sum(const vf* probability) {
  vf lanes[W];
  for (int j = 0; j < W; ++j) {
    lanes[j] = probability[j];
#pragma GCC unroll 2
    for (int t = 1; t < TV; ++t) lanes[j] += probability[t * W + j];
  }
  for (int half = W / 2; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) lanes[j] = lanes[j] + lanes[j + half];
  return lanes[0];
}

// One lane item of V vectors of rows over every key tile its rows may see; o: V * W * head_dim
// floats of scratch.
template <int V>
inline void attend_lane_item(const Problem& p, const LaneItem& item, int64_t kv_head, float* o, float* out) {
  constexpr int R = V * W;
  alignas(64) float probs[T * R];  // probs[j * R + r]
  alignas(64) float rescale[R], total_rows[R];
  vf s[V][T];
  const float* values[T];
  vf top[V], total[V];
  for (int v = 0; v < V; ++v) top[v] = splat(-__builtin_inff()), total[v] = vf{};
  std::fill(o, o + R * p.head_dim, 0.0f);
  const vf minus_infinity = splat(-__builtin_inff());
  for (int64_t key0 = tile_of(item.item_first_key); key0 <= item.last_position; key0 += T) {
    score_lanes<V>(p, item, kv_head, key0, s);
    const bool masked = key0 + T - 1 > item.first_position || key0 < item.last_first_key;
    for (int v = 0; v < V; ++v) {
      if (masked)
        for (int j = 0; j < T; ++j) {
          const vi key = splat_int(static_cast<int32_t>(key0 + j));
          s[v][j] = (key > item.position[v]) | (key < item.first_key[v]) ? minus_infinity : s[v][j];
        }
      vf next = top[v];
      for (int j = 0; j < T; ++j) next = next > s[v][j] ? next : s[v][j];
      const vf base = softmax_base(next);
      for (int j = 0; j < T; ++j) {
        s[v][j] = exp_negative(s[v][j] - base);
        store(probs + j * R + v * W, s[v][j]);
      }
      const vf rescaled = exp_negative(top[v] - base);  // 0 on a row's first tile, where top is -inf
      total[v] = total[v] * rescaled + tile_sum(s[v]);
      top[v] = next;
      store(rescale + v * W, rescaled);
    }
    const int64_t skip = std::max<int64_t>(0, item.item_first_key - key0);  // as attend_item's
    const int64_t keys = std::min<int64_t>(T, item.last_position + 1 - key0);
    for (int64_t j = skip; j < keys; ++j) values[j] = p.value(key0 + j, kv_head);
    weigh_tile<R, RPL, 1, R>(p, values + skip, keys - skip, probs + skip * R, rescale, o);
  }
  for (int v = 0; v < V; ++v) store(total_rows + v * W, total[v]);
  write_rows(p, item.q, item.real_rows, o, total_rows, out);
}

// A lane item's rows: vectors [begin, begin + vectors) of W rows of one KV head.
struct LaneSpan {
  int64_t kv_head, begin, vectors;
};

// The items: each KV head's rows cut into vectors of W, the vectors into items of up to LV, the last
// rows (the most keys) first. The threads take items as they finish, so a count the threads do not
// divide leaves some idle for the last item's time: 14 queries of SmolLM2 are one item of 3 vectors
// a KV head, 3 items for 2 threads. Then the first items of two vectors or more are split in two,
// until the threads divide them (or none is left to split): a split costs a second read of that
// head's K/V, which is less than an idle thread.
inline std::vector<LaneSpan> lane_spans(const Problem& p, int64_t threads) {
  const int64_t vectors_per_head = (p.tokens * (p.heads / p.kv_heads) + W - 1) / W;
  std::vector<LaneSpan> spans;
  for (int64_t h = 0; h < p.kv_heads; ++h)
    for (int64_t end = vectors_per_head; end > 0; end -= LV) {
      const int64_t begin = std::max<int64_t>(0, end - LV);
      spans.push_back({h, begin, end - begin});
    }
  for (size_t i = 0; spans.size() % threads != 0 && i < spans.size(); ++i) {
    const LaneSpan whole = spans[i];
    if (whole.vectors < 2) continue;  // a head's first rows, the remainder of its vectors
    // the first item takes the later rows (more keys each), the smaller half
    const int64_t first = whole.vectors / 2;
    spans[i] = {whole.kv_head, whole.begin + whole.vectors - first, first};
    spans.insert(spans.begin() + static_cast<int64_t>(i) + 1, {whole.kv_head, whole.begin, whole.vectors - first});
    ++i;  // past the second half
  }
  return spans;
}

// A span's rows, ordered as item_rows orders the tiled path's.
inline LaneItem lane_item_rows(const Problem& p, const LaneSpan& span, float* q_by_dim) {
  const int64_t group = p.heads / p.kv_heads, rows = p.tokens * group;
  LaneItem item{};
  item.vectors = static_cast<int>(span.vectors);
  const int64_t first = span.begin * W, width = item.vectors * W;
  item.real_rows = std::min<int64_t>(width, rows - first);
  item.q_by_dim = q_by_dim;
  for (int64_t r = 0; r < width; ++r) {
    const int64_t row = first + std::min(r, item.real_rows - 1), i = row / group;
    const int64_t h = span.kv_head * group + row % group;
    item.q[r] = p.q + (i * p.heads + h) * p.head_dim;
    item.position[r / W][r % W] = static_cast<int32_t>(p.start + i);
    item.first_key[r / W][r % W] = static_cast<int32_t>(p.first_key(p.start + i));
    for (int64_t d = 0; d < p.head_dim; ++d) q_by_dim[d * width + r] = item.q[r][d];
  }
  item.first_position = item.position[0][0];
  item.last_position = item.position[item.vectors - 1][W - 1];
  item.item_first_key = item.first_key[0][0];
  item.last_first_key = item.first_key[item.vectors - 1][W - 1];
  return item;
}

// attend_lane_item for the item's own count of vectors, V or fewer.
template <int V>
inline void attend_lane_item_of(const Problem& p, const LaneItem& item, int64_t kv_head, float* o, float* out) {
  if constexpr (V > 1) {
    if (item.vectors < V) return attend_lane_item_of<V - 1>(p, item, kv_head, o, out);
  }
  attend_lane_item<V>(p, item, kv_head, o, out);
}

inline void attend_lanes(const Problem& p, float* out) {
  const std::vector<LaneSpan> spans = lane_spans(p, at::get_num_threads());
  const int64_t items = static_cast<int64_t>(spans.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> o(static_cast<size_t>(LV * W * p.head_dim)), q_by_dim(o.size());
    for (int64_t k = next++; k < items; k = next++) {
      const LaneItem item = lane_item_rows(p, spans[k], q_by_dim.data());
      attend_lane_item_of<LV>(p, item, spans[k].kv_head, o.data(), out);
    }
  });
}

inline void attend(const Problem& p, float* out) {
  std::vector<float> kts(static_cast<size_t>(p.kv_heads * transposed_tiles(p) * p.head_dim * W));
  transpose_keys(p, kts.data());
  const int64_t row_tiles = (p.tokens * (p.heads / p.kv_heads) + kRows - 1) / kRows;
  const int64_t items = row_tiles * p.kv_heads;
  std::atomic<int64_t> next{0};  // items are taken one at a time: within a head, longest first
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> o(static_cast<size_t>(kRows * p.head_dim)), q_by_dim(o.size());
    for (int64_t k = next++; k < items; k = next++)
      attend_item(p, item_rows(p, k, row_tiles, q_by_dim.data()), item_kv_head(k, row_tiles), kts.data(),
                  o.data(), out);
  });
}
