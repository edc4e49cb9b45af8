#pragma once
// The subsampled randomised Hadamard map of the "srht" mapper family, written once for both backends
// (kernels/cpu/srht.cpp, kernels/cuda/srht.cu): the plan, the seeded signs and permutations (Philox,
// regenerated where they are used, so the map holds no state), and the per-element float steps.
//
// The map W [rows, cols] (rows >= cols = L, P = the smallest power of two >= L, rows >= P) has
// k = floor(rows / P) blocks; block b produces rows [b P, b P + P) (the last one [b P, rows), P + r
// rows with r = rows mod P):
//   x = pad(z, P) * s1_b              (s1_b: seeded +-1 signs)
//   x = H x                           (fast Walsh-Hadamard transform, unnormalised: H H = P I)
//   v_i = s2_b[i] * x[perm_b(i)]      (perm_b: a seeded bijection of [0, P))
//   rows b P + i = scale * v_i
// and the last block, when r > 0, spreads v over P + r rows with an isometry: rows i < r take
// c v_i; the other P rows are H (s3 * t) / sqrt(P) with t = (v_r, ..., v_{P-1}, s v_0, ..., s v_{r-1}),
// c = sqrt(P / (P + r)), s = sqrt(r / (P + r)) (c^2 + s^2 = 1, so it is orthogonal, and every row has
// the same expected norm). Every block is an isometry of pad(z) times sqrt(P), so
// W^T W = k P scale^2 I, and scale = expansion / sqrt(k P) gives W^T W = expansion^2 I.
// Fastfood's per-element Gaussian scaling is left out: it would break that exact orthogonality.
//
// Bit-identical on CPU and CUDA: the FWHT runs its butterflies stage by stage (h = 1, 2, 4, ...),
// each output one float add or subtract of the same two inputs; every other step is one rounded
// multiply by a constant computed on the host (or an exact sign flip), and the one sum of two
// products (the transpose of the tail's split) is written as two rounded products and a rounded add
// (CPU: the file is compiled with -ffp-contract=off; CUDA: __fmul_rn / __fadd_rn). The transpose
// sums the blocks' contributions in block order.
#include <cstdint>

#include "core/host_device.h"
#include "core/philox.h"

namespace mn::kernels {

struct SrhtPlan {
  int64_t rows = 0, cols = 0;  // W is rows x cols, rows >= pow2 >= cols
  int64_t pow2 = 0;            // P
  int64_t blocks = 0;          // k = rows / P
  int64_t tail = 0;            // r = rows - k P (spread over the last block)
  uint64_t seed = 0, stream = 0;
  float scale = 1;             // expansion / sqrt(k P): rows of full blocks
  float tail_head = 1;         // scale * c: the last block's first r rows
  float tail_mix = 1;          // scale / sqrt(P): the last block's other P rows
  float split = 0;             // s, the share of v_i that moves into the mixed part
};

// Which seeded quantity a Philox draw is for (part of the stream, so they are independent).
enum class SrhtDraw : uint32_t { InputSigns = 1, OutputSigns = 2, TailSigns = 3, Permutation = 4 };

MN_HOST_DEVICE inline Philox4 srht_draw(const SrhtPlan& p, SrhtDraw which, int64_t block, uint64_t word) {
  const uint64_t stream = p.stream ^ (0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(which));
  return philox_block(p.seed, stream, (static_cast<uint64_t>(block) << 32) | word);
}

// +1 or -1 for element i of block `block`: one bit of the Philox block holding i (128 bits per block).
MN_HOST_DEVICE inline float srht_sign(const SrhtPlan& p, SrhtDraw which, int64_t block, int64_t i) {
  const Philox4 r = srht_draw(p, which, block, static_cast<uint64_t>(i) >> 7);
  const uint32_t word = r.x[(i >> 5) & 3];
  return ((word >> (i & 31)) & 1u) ? 1.0f : -1.0f;
}

// perm_b(i) = ((a i + c) mod P) xor x with a odd: a bijection of [0, P) from three seeded words.
struct SrhtPerm {
  uint64_t a, c, x, mask;
  MN_HOST_DEVICE int64_t operator()(int64_t i) const {
    return static_cast<int64_t>(((a * static_cast<uint64_t>(i) + c) & mask) ^ x);
  }
};

MN_HOST_DEVICE inline SrhtPerm srht_perm(const SrhtPlan& p, int64_t block) {
  const Philox4 r = srht_draw(p, SrhtDraw::Permutation, block, 0);
  const uint64_t mask = static_cast<uint64_t>(p.pow2) - 1;
  const uint64_t a = (static_cast<uint64_t>(r.x[0]) | (static_cast<uint64_t>(r.x[1]) << 32)) & mask;
  return {a | 1u, static_cast<uint64_t>(r.x[2]) & mask, static_cast<uint64_t>(r.x[3]) & mask, mask};
}

// Rows of block b: P, or P + r for the last block.
MN_HOST_DEVICE inline int64_t srht_block_rows(const SrhtPlan& p, int64_t block) {
  return block + 1 == p.blocks ? p.pow2 + p.tail : p.pow2;
}

}  // namespace mn::kernels
