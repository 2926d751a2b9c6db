// XXH3-64 with seed 0 and the default secret: the checksum of every KV block on the wire
// (pdserve/kvwire.py, block_checksum = xxhash.xxh3_64_intdigest), here so that kv_blocks.cpp can
// hash a block while it sits in L1, between copying it and copying the next.
//
// Written from the published algorithm (xxHash's XXH3, by Yann Collet): the same value as the
// xxhash package for every length, which tests/engine/test_kv_blocks.py checks from 0 to 4,200
// bytes and at the block sizes the pools use. Inputs over 240 bytes, every KV block of a real
// model, take the striped path, 8 lanes of 64 bits on two AVX2 registers; shorter ones the
// scalar short paths.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pdserve_xxh3 {

constexpr uint64_t kPrime32_1 = 0x9E3779B1ULL;
constexpr uint64_t kPrime32_2 = 0x85EBCA77ULL;
constexpr uint64_t kPrime32_3 = 0xC2B2AE3DULL;
constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;
constexpr uint64_t kMix1 = 0x165667919E3779F9ULL;
constexpr uint64_t kMix2 = 0x9FB21C651E98DF25ULL;

constexpr size_t kSecretBytes = 192;
constexpr size_t kStripeBytes = 64;    // one accumulate step: 8 lanes of 8 bytes
constexpr size_t kSecretStep = 8;      // the secret slides this far a stripe
constexpr size_t kStripesPerRound = (kSecretBytes - kStripeBytes) / kSecretStep;  // 16
constexpr size_t kRoundBytes = kStripeBytes * kStripesPerRound;                   // 1,024
constexpr size_t kMidsizeMax = 240;

alignas(64) inline constexpr uint8_t kSecret[kSecretBytes] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

// Little-endian loads (x86 is little-endian; memcpy keeps unaligned reads defined).
inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t fold_product(uint64_t a, uint64_t b) {  // the 128-bit product's halves, xored
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kMix1;
  return h ^ (h >> 32);
}

inline uint64_t avalanche_xxh64(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  return h ^ (h >> 32);
}

inline uint64_t mix16(const uint8_t* in, const uint8_t* secret) {
  return fold_product(load64(in) ^ load64(secret), load64(in + 8) ^ load64(secret + 8));
}

inline uint64_t hash_up_to_16(const uint8_t* in, size_t len) {
  if (len > 8) {
    const uint64_t lo = load64(in) ^ (load64(kSecret + 24) ^ load64(kSecret + 32));
    const uint64_t hi = load64(in + len - 8) ^ (load64(kSecret + 40) ^ load64(kSecret + 48));
    return avalanche(len + __builtin_bswap64(lo) + hi + fold_product(lo, hi));
  }
  if (len >= 4) {
    const uint64_t joined = load32(in + len - 4) + (static_cast<uint64_t>(load32(in)) << 32);
    uint64_t h = joined ^ (load64(kSecret + 8) ^ load64(kSecret + 16));
    h ^= rotl(h, 49) ^ rotl(h, 24);
    h *= kMix2;
    h ^= (h >> 35) + len;
    h *= kMix2;
    return h ^ (h >> 28);
  }
  if (len > 0) {
    const uint32_t joined = (static_cast<uint32_t>(in[0]) << 16) | (static_cast<uint32_t>(in[len >> 1]) << 24) |
                            static_cast<uint32_t>(in[len - 1]) | (static_cast<uint32_t>(len) << 8);
    return avalanche_xxh64(joined ^ static_cast<uint64_t>(load32(kSecret) ^ load32(kSecret + 4)));
  }
  return avalanche_xxh64(load64(kSecret + 56) ^ load64(kSecret + 64));
}

inline uint64_t hash_17_to_128(const uint8_t* in, size_t len) {
  uint64_t acc = len * kPrime64_1;
  // pairs from both ends, outermost first: (0, len-16), (16, len-32), (32, len-48), (48, len-64)
  const size_t pairs = len > 96 ? 4 : len > 64 ? 3 : len > 32 ? 2 : 1;
  for (size_t i = 0; i < pairs; ++i) {
    acc += mix16(in + 16 * i, kSecret + 32 * i);
    acc += mix16(in + len - 16 * (i + 1), kSecret + 32 * i + 16);
  }
  return avalanche(acc);
}

inline uint64_t hash_129_to_240(const uint8_t* in, size_t len) {
  uint64_t acc = len * kPrime64_1;
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, kSecret + 16 * i);
  acc = avalanche(acc);
  uint64_t tail = mix16(in + len - 16, kSecret + 136 - 17);
  for (size_t i = 8; i < len / 16; ++i) tail += mix16(in + 16 * i, kSecret + 16 * (i - 8) + 3);
  return avalanche(acc + tail);
}

// The striped path: 8 accumulators of 64 bits, lanes 0-3 in lo and 4-7 in hi.
struct Lanes {
  __m256i lo, hi;
};

inline __m256i accumulate_half(__m256i acc, const uint8_t* in, const uint8_t* secret) {
  const __m256i data = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
  const __m256i key = _mm256_xor_si256(data, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret)));
  const __m256i product = _mm256_mul_epu32(key, _mm256_srli_epi64(key, 32));  // low 32 x high 32 bits
  const __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));  // lane i gets lane i^1
  return _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped));
}

inline void accumulate_stripe(Lanes& acc, const uint8_t* in, const uint8_t* secret) {
  acc.lo = accumulate_half(acc.lo, in, secret);
  acc.hi = accumulate_half(acc.hi, in + 32, secret + 32);
}

inline __m256i scramble_half(__m256i acc, const uint8_t* secret) {
  acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
  acc = _mm256_xor_si256(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret)));
  const __m256i prime = _mm256_set1_epi64x(static_cast<int64_t>(kPrime32_1));
  const __m256i low = _mm256_mul_epu32(acc, prime);
  const __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
  return _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));  // acc * prime, mod 2^64
}

inline void scramble(Lanes& acc) {
  const uint8_t* secret = kSecret + kSecretBytes - kStripeBytes;
  acc.lo = scramble_half(acc.lo, secret);
  acc.hi = scramble_half(acc.hi, secret + 32);
}

inline __m256i lanes_of(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  return _mm256_setr_epi64x(static_cast<int64_t>(a), static_cast<int64_t>(b), static_cast<int64_t>(c),
                            static_cast<int64_t>(d));
}

inline uint64_t hash_long(const uint8_t* in, size_t len) {
  Lanes acc{lanes_of(kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3),
            lanes_of(kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1)};
  const size_t rounds = (len - 1) / kRoundBytes;
  for (size_t r = 0; r < rounds; ++r) {
    const uint8_t* round = in + r * kRoundBytes;
    for (size_t s = 0; s < kStripesPerRound; ++s) accumulate_stripe(acc, round + s * kStripeBytes, kSecret + s * kSecretStep);
    scramble(acc);
  }
  const uint8_t* rest = in + rounds * kRoundBytes;
  const size_t stripes = ((len - 1) - rounds * kRoundBytes) / kStripeBytes;
  for (size_t s = 0; s < stripes; ++s) accumulate_stripe(acc, rest + s * kStripeBytes, kSecret + s * kSecretStep);
  accumulate_stripe(acc, in + len - kStripeBytes, kSecret + kSecretBytes - kStripeBytes - 7);

  alignas(32) uint64_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc.lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 4), acc.hi);
  uint64_t h = len * kPrime64_1;
  for (size_t i = 0; i < 4; ++i) {
    h += fold_product(lanes[2 * i] ^ load64(kSecret + 11 + 16 * i), lanes[2 * i + 1] ^ load64(kSecret + 11 + 16 * i + 8));
  }
  return avalanche(h);
}

inline uint64_t hash(const uint8_t* in, size_t len) {
  if (len <= 16) return hash_up_to_16(in, len);
  if (len <= 128) return hash_17_to_128(in, len);
  if (len <= kMidsizeMax) return hash_129_to_240(in, len);
  return hash_long(in, len);
}

}  // namespace pdserve_xxh3
