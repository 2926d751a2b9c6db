// KV blocks to and from the wire in one pass each (pdserve/kvwire.py; the format is its docstring's).
//
// A LAYER frame carries whole pool blocks, each block's K rows then its V rows, and each block's
// xxh3_64 in the frame's header. In Python that was a pass per step over every byte: the sender
// gathered the blocks into a staging buffer, hashed them there, then joined header and payload into
// the message gRPC sends; the receiver hashed the received blocks, then copied them into the pool.
// Each pass cost about as much again as gRPC's own work (`python -m bench.kv_transfer_wire --stages`;
// docs/benchmarks.md, "KV transfer"). Here each block is copied and
// hashed while it sits in L1:
//
//   pack_layer_frame     the whole KVChunk message in one new bytes object: the message's prefix
//                        (its tags, lengths and the msgpack header, whose checksums are placeholders
//                        of 9 bytes each: 0xcf and a 64-bit big-endian value), then every block
//                        copied from the pool and hashed, its checksum written into its placeholder.
//   verify_write_layer   every block of a received payload hashed, and copied into the pool only if
//                        its checksum matches; returns the index of the first block that did not (the
//                        blocks before it are written: they verified), or -1.
//
// Both leave the GIL while they copy, so gRPC's threads run meanwhile. The pool layer is
// [2, num_blocks, ...] (K, V), contiguous, any dtype: only bytes move.

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xxh3.h"

namespace {

constexpr uint8_t kMsgpackUint64 = 0xcf;
constexpr size_t kSlotBytes = 9;  // a checksum's placeholder in the header: 0xcf, then 8 bytes big-endian

struct PoolLayer {
  uint8_t* base;
  int64_t num_blocks;
  size_t half_bytes;  // a block's K rows (or V rows), in bytes

  uint8_t* keys(int64_t block) const { return base + block * half_bytes; }
  uint8_t* values(int64_t block) const { return base + (num_blocks + block) * half_bytes; }
};

PoolLayer pool_layer(const at::Tensor& layer) {
  TORCH_CHECK(layer.device().is_cpu(), "kv_blocks: the pool layer must be on the CPU, got ", layer.device());
  TORCH_CHECK(layer.dim() >= 2 && layer.size(0) == 2, "kv_blocks: the pool layer must be [2, num_blocks, ...], got ",
              layer.sizes());
  TORCH_CHECK(layer.is_contiguous(), "kv_blocks: the pool layer must be contiguous");
  const int64_t num_blocks = layer.size(1);
  const size_t half = num_blocks ? static_cast<size_t>(layer.numel() / (2 * num_blocks)) * layer.element_size() : 0;
  return {static_cast<uint8_t*>(layer.data_ptr()), num_blocks, half};
}

void check_ids(const std::vector<int64_t>& ids, const PoolLayer& pool) {
  for (int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id < pool.num_blocks, "kv_blocks: block id ", id, " is outside the pool's ",
                pool.num_blocks, " blocks");
  }
}

// A copy into the pool that bypasses the cache where it can (32-byte aligned, whole vectors): the
// pool's lines are not read first, as an ordinary store must, and a transfer's blocks are not read
// again until a decode step (callers fence with _mm_sfence before returning).
void copy_to_pool(uint8_t* dst, const uint8_t* src, size_t n) {
  if (reinterpret_cast<uintptr_t>(dst) % 32 != 0 || n % 128 != 0) {
    std::memcpy(dst, src, n);
    return;
  }
  for (size_t i = 0; i < n; i += 128) {
    const auto* from = reinterpret_cast<const __m256i*>(src + i);
    auto* to = reinterpret_cast<__m256i*>(dst + i);
    const __m256i a = _mm256_loadu_si256(from), b = _mm256_loadu_si256(from + 1);
    const __m256i c = _mm256_loadu_si256(from + 2), d = _mm256_loadu_si256(from + 3);
    _mm256_stream_si256(to, a);
    _mm256_stream_si256(to + 1, b);
    _mm256_stream_si256(to + 2, c);
    _mm256_stream_si256(to + 3, d);
  }
}

void put_be64(uint8_t* at, uint64_t value) {
  const uint64_t be = __builtin_bswap64(value);
  std::memcpy(at, &be, 8);
}

py::buffer_info contiguous(const py::buffer& data) {
  py::buffer_info info = data.request();
  TORCH_CHECK(info.ndim <= 1 && (info.ndim == 0 || info.strides[0] == info.itemsize),
              "kv_blocks: the buffer must be one contiguous run of bytes");
  return info;
}

py::bytes pack_layer_frame(const at::Tensor& layer, const std::vector<int64_t>& block_ids,
                           const py::bytes& prefix, int64_t first_checksum) {
  const PoolLayer pool = pool_layer(layer);
  check_ids(block_ids, pool);
  const std::string_view head = prefix;
  const size_t n = block_ids.size(), block_bytes = 2 * pool.half_bytes;
  TORCH_CHECK(first_checksum >= 1 && static_cast<size_t>(first_checksum) + kSlotBytes * n <= head.size() + 1,
              "kv_blocks: ", n, " checksum placeholders from byte ", first_checksum, " do not fit a prefix of ",
              head.size(), " bytes");
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(static_cast<uint8_t>(head[first_checksum - 1 + kSlotBytes * i]) == kMsgpackUint64,
                "kv_blocks: checksum placeholder ", i, " is not a msgpack uint 64");
  }
  PyObject* message = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(head.size() + n * block_bytes));
  if (message == nullptr) throw py::error_already_set();
  auto* out = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(message));
  {
    py::gil_scoped_release no_gil;
    std::memcpy(out, head.data(), head.size());
    uint8_t* block = out + head.size();
    for (size_t i = 0; i < n; ++i, block += block_bytes) {
      std::memcpy(block, pool.keys(block_ids[i]), pool.half_bytes);
      std::memcpy(block + pool.half_bytes, pool.values(block_ids[i]), pool.half_bytes);
      put_be64(out + first_checksum + kSlotBytes * i, pdserve_xxh3::hash(block, block_bytes));
    }
  }
  return py::reinterpret_steal<py::bytes>(message);
}

int64_t verify_write_layer(const py::buffer& payload, const std::vector<uint64_t>& checksums,
                           const at::Tensor& layer, const std::vector<int64_t>& block_ids) {
  const PoolLayer pool = pool_layer(layer);
  check_ids(block_ids, pool);
  const py::buffer_info info = contiguous(payload);
  const size_t n = block_ids.size(), block_bytes = 2 * pool.half_bytes;
  TORCH_CHECK(checksums.size() == n, "kv_blocks: ", checksums.size(), " checksums for ", n, " blocks");
  TORCH_CHECK(static_cast<size_t>(info.size * info.itemsize) == n * block_bytes, "kv_blocks: the payload has ",
              info.size * info.itemsize, " bytes, ", n, " blocks of ", block_bytes, " need ", n * block_bytes);
  const auto* block = static_cast<const uint8_t*>(info.ptr);
  py::gil_scoped_release no_gil;
  int64_t bad = -1;
  for (size_t i = 0; i < n; ++i, block += block_bytes) {
    if (pdserve_xxh3::hash(block, block_bytes) != checksums[i]) {
      bad = static_cast<int64_t>(i);
      break;
    }
    copy_to_pool(pool.keys(block_ids[i]), block, pool.half_bytes);
    copy_to_pool(pool.values(block_ids[i]), block + pool.half_bytes, pool.half_bytes);
  }
  _mm_sfence();
  return bad;
}

uint64_t checksum(const py::buffer& data) {
  const py::buffer_info info = contiguous(data);
  return pdserve_xxh3::hash(static_cast<const uint8_t*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_layer_frame", &pack_layer_frame, "A LAYER frame's KVChunk message: prefix, then the blocks, hashed");
  m.def("verify_write_layer", &verify_write_layer, "Verify each block, write it into the pool; the first bad index or -1");
  m.def("checksum", &checksum, "xxh3_64 of a buffer (the wire's block checksum)");
}
