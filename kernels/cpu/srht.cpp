// CPU kernels of the srht mapper family (kernels/srht_math.h): y = W z and g = W^T u, one Hadamard
// block per OpenMP task. Each block is computed the same way whichever thread runs it, and the
// transpose adds the blocks' contributions in block order, so the bits do not depend on the thread
// count. Built with -ffp-contract=off (CMakeLists.txt), so the CUDA twin gets the same roundings.
#include <tuple>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/kernels.h"
#include "kernels/srht_math.h"

namespace mn::kernels {
namespace {

// In place, unnormalised, stage by stage (h = 1, 2, 4, ...): the order kernels/cuda/srht.cu follows.
void fwht(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// The first n signs of one draw of block `block` (srht_sign's bits, 128 per Philox call).
void fill_signs(const SrhtPlan& p, SrhtDraw which, int64_t block, int64_t n, float* out) {
  for (int64_t w = 0; w * 128 < n; ++w) {
    const Philox4 r = srht_draw(p, which, block, static_cast<uint64_t>(w));
    for (int64_t i = w * 128; i < n && i < (w + 1) * 128; ++i)
      out[i] = ((r.x[(i >> 5) & 3] >> (i & 31)) & 1u) ? 1.0f : -1.0f;
  }
}

void check_operands(const char* op, const SrhtPlan& p, const Tensor& in, int64_t in_n, const Tensor& out,
                    int64_t out_n) {
  MN_CHECK(p.pow2 > 0 && (p.pow2 & (p.pow2 - 1)) == 0 && p.cols <= p.pow2 && p.blocks >= 1 && p.tail >= 0 &&
               p.tail < p.pow2 && p.blocks * p.pow2 + p.tail == p.rows,
           ValueError, op, ": inconsistent plan (rows ", p.rows, ", cols ", p.cols, ", P ", p.pow2, ", blocks ",
           p.blocks, ", tail ", p.tail, ")");
  for (const auto& [t, n, name] : {std::tuple{&in, in_n, "input"}, std::tuple{&out, out_n, "output"}}) {
    MN_CHECK(t->dtype() == DType::f32 && t->dim() == 1 && t->size(0) == n && t->is_contiguous(), ValueError, op,
             ": expected a contiguous f32 ", name, " of shape [", n, "], got ", t->dtype(), t->sizes());
  }
}

// Block b's v (length P) from z: v_i = s2[i] * (H (s1 * pad(z)))[perm(i)].
void block_forward_v(const SrhtPlan& p, int64_t b, const float* z, float* x, float* signs, float* v) {
  const int64_t P = p.pow2;
  fill_signs(p, SrhtDraw::InputSigns, b, p.cols, signs);
  for (int64_t i = 0; i < P; ++i) x[i] = i < p.cols ? signs[i] * z[i] : 0.0f;
  fwht(x, P);
  fill_signs(p, SrhtDraw::OutputSigns, b, P, signs);
  const SrhtPerm perm = srht_perm(p, b);
  for (int64_t i = 0; i < P; ++i) v[i] = signs[i] * x[perm(i)];
}

void srht_apply_cpu(const SrhtPlan& p, const Tensor& z, Tensor& y) {
  check_operands("srht_apply", p, z, p.cols, y, p.rows);
  const int64_t P = p.pow2, r = p.tail;
  const float* zp = z.data<float>();
  float* yp = y.data<float>();
  const int team = cpu::parallel_team(p.rows);
#pragma omp parallel num_threads(team) if (team > 1 && p.blocks > 1)
  {
    std::vector<float> x(static_cast<size_t>(P)), v(static_cast<size_t>(P)), signs(static_cast<size_t>(P));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.blocks; ++b) {
      block_forward_v(p, b, zp, x.data(), signs.data(), v.data());
      float* out = yp + b * P;
      if (b + 1 < p.blocks || r == 0) {
        for (int64_t i = 0; i < P; ++i) out[i] = p.scale * v[i];
        continue;
      }
      // The last block: rows i < r keep c v_i, the other P rows mix t = (v_r.., s v_0..) by s3 and H.
      for (int64_t i = 0; i < r; ++i) out[i] = p.tail_head * v[i];
      fill_signs(p, SrhtDraw::TailSigns, b, P, signs.data());
      for (int64_t j = 0; j < P; ++j) x[j] = signs[j] * (r + j < P ? v[r + j] : p.split * v[r + j - P]);
      fwht(x.data(), P);
      for (int64_t j = 0; j < P; ++j) out[r + j] = p.tail_mix * x[j];
    }
  }
}

void srht_apply_transpose_cpu(const SrhtPlan& p, const Tensor& u, Tensor& g) {
  check_operands("srht_apply_transpose", p, u, p.rows, g, p.cols);
  const int64_t P = p.pow2, r = p.tail, L = p.cols;
  const float* up = u.data<float>();
  std::vector<float> partial(static_cast<size_t>(p.blocks * L));
  const int team = cpu::parallel_team(p.rows);
#pragma omp parallel num_threads(team) if (team > 1 && p.blocks > 1)
  {
    std::vector<float> x(static_cast<size_t>(P)), v(static_cast<size_t>(P)), t(static_cast<size_t>(P)),
        signs(static_cast<size_t>(P));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.blocks; ++b) {
      const float* in = up + b * P;
      if (b + 1 < p.blocks || r == 0) {
        for (int64_t i = 0; i < P; ++i) v[i] = p.scale * in[i];
      } else {
        // Transpose of the tail's spread: t = s3 * H (tail_mix * u[r..]), then v_i = c' u_i + s t_{P-r+i}.
        for (int64_t j = 0; j < P; ++j) t[j] = p.tail_mix * in[r + j];
        fwht(t.data(), P);
        fill_signs(p, SrhtDraw::TailSigns, b, P, signs.data());
        for (int64_t j = 0; j < P; ++j) t[j] = signs[j] * t[j];
        for (int64_t i = 0; i < r; ++i) {
          const float head = p.tail_head * in[i];
          const float moved = p.split * t[P - r + i];
          v[i] = head + moved;
        }
        for (int64_t i = r; i < P; ++i) v[i] = t[i - r];
      }
      fill_signs(p, SrhtDraw::OutputSigns, b, P, signs.data());
      const SrhtPerm perm = srht_perm(p, b);
      for (int64_t i = 0; i < P; ++i) x[perm(i)] = signs[i] * v[i];
      fwht(x.data(), P);
      fill_signs(p, SrhtDraw::InputSigns, b, L, signs.data());
      for (int64_t j = 0; j < L; ++j) partial[static_cast<size_t>(b * L + j)] = signs[j] * x[j];
    }
  }
  // The blocks' contributions, added in block order for every output element.
  float* gp = g.data<float>();
  const int sum_team = cpu::parallel_team(p.blocks * L);
#pragma omp parallel for schedule(static) num_threads(sum_team) if (sum_team > 1)
  for (int64_t j = 0; j < L; ++j) {
    float acc = 0.0f;
    for (int64_t b = 0; b < p.blocks; ++b) acc += partial[static_cast<size_t>(b * L + j)];
    gp[j] = acc;
  }
}

}  // namespace

void register_cpu_srht() {
  srht_apply.set(DeviceType::CPU, srht_apply_cpu);
  srht_apply_transpose.set(DeviceType::CPU, srht_apply_transpose_cpu);
}

}  // namespace mn::kernels
