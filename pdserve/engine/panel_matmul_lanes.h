// The body of pdserve's panel matmul for one vector width: panel_matmul.cpp includes it twice, in
// namespace lanes16 under `#pragma GCC target("avx512f")` and in namespace lanes8 under the file's
// -mavx2 -mfma, each after defining W (lanes), kBlockRows (rows of x a block), vf (a GCC vector of W
// floats) and splat(float). Written in GCC's vector extensions, so the one text compiles to either.

constexpr int P = kPanelVectors * W;  // columns of a panel

inline vf load(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

// y[r][0, P) = sum_i x[r][i] * panel[i][0, P) for R rows of x (row stride in): each output sums
// its inputs in order in stretches of kStretch, a stretch's sum in one register lane and the
// stretches' sums added in order; `columns` of the P are written (the last panel's may be fewer).
template <int R>
inline void block(const float* x, const float* panel, int64_t in, float* y, int64_t y_stride, int64_t columns) {
  vf total[R][kPanelVectors];
  for (int64_t i0 = 0; i0 < in; i0 += kStretch) {
    vf sum[R][kPanelVectors];
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < kPanelVectors; ++v) sum[r][v] = vf{};
    const int64_t end = std::min<int64_t>(in, i0 + kStretch);
    for (int64_t i = i0; i < end; ++i) {
      __builtin_prefetch(panel + (i + kPrefetchSteps) * P);
      if (P * 4 > 64) __builtin_prefetch(panel + (i + kPrefetchSteps) * P + 16);
      vf w[kPanelVectors];
#pragma GCC unroll 2
      for (int v = 0; v < kPanelVectors; ++v) w[v] = load(panel + i * P + v * W);
#pragma GCC unroll 14
      for (int r = 0; r < R; ++r) {
        const vf xr = splat(x[r * in + i]);
#pragma GCC unroll 2
        for (int v = 0; v < kPanelVectors; ++v) sum[r][v] += xr * w[v];
      }
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < kPanelVectors; ++v) total[r][v] = i0 == 0 ? sum[r][v] : total[r][v] + sum[r][v];
  }
  alignas(64) float row[P];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kPanelVectors; ++v) store(row + v * W, total[r][v]);
    std::copy(row, row + columns, y + r * y_stride);
  }
}

template <int R>
inline void block_if(int64_t rows, const float* x, const float* panel, int64_t in, float* y, int64_t y_stride,
                     int64_t columns) {
  if constexpr (R >= 1) {
    if (rows == R) return block<R>(x, panel, in, y, y_stride, columns);
    block_if<R - 1>(rows, x, panel, in, y, y_stride, columns);
  }
}

// Every row of x against one panel: blocks of at most kBlockRows rows, as even as possible.
inline void panel_rows(const float* x, int64_t m, const float* panel, int64_t in, float* y, int64_t out,
                       int64_t columns) {
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  int64_t first = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t rows = (m - first) / (blocks - b);
    block_if<kBlockRows>(rows, x + first * in, panel, in, y + first * out, out, columns);
    first += rows;
  }
}

inline void matmul(const torch::Tensor& x, const torch::Tensor& panels, torch::Tensor& y) {
  const int64_t m = x.size(0), in = x.size(1), count = panels.size(0), out = y.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel_rows(xp, m, wp + p * in * P, in, yp + p * P, out, std::min<int64_t>(P, out - p * P));
  });
}
