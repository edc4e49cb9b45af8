// CPU kernels of one mapped group (kernels.h: mapped_group_forward, mapped_group_backward): the
// mapper GEMM with the sign products, the modulation term and the per-element scale applied while the
// rows are in cache, written straight into the output (which may be a slice of the generated parameter
// buffer). No temporary of the group's size exists: a small block (L at most a chunk's rows) works
// against one [L, L] buffer, a large one against Q^T packed one K block at a time in each thread's GEMM
// packing buffer (forward) or chunk-sized buffers per thread (backward; the scaled gradient only with
// scales).
//
// Every output element's sum depends only on the shapes: the backward's work is cut into chunks whose
// bounds depend only on the shapes, each computed by one serial GEMM, and their partial sums are added
// in chunk order; the forward cuts its sign rows to suit the team only where the packed GEMM computes
// them (each row its own chain of sums there). So the bits do not depend on the thread count or on
// which thread ran what.
#include <omp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/eigen_gemm.h"
#include "kernels/cpu/packed_gemm.h"
#include "kernels/kernels.h"

namespace mn::kernels {
namespace {

using cpu::MatrixRef;

// Values per chunk (rows x L): 256 KB, so a chunk and its GEMM result stay in a core's L2.
constexpr int64_t kChunkFloats = int64_t{1} << 16;
// Below this many multiply-adds the group runs on the calling thread.
constexpr int64_t kSerialWork = int64_t{1} << 18;

struct GroupShape {
  int64_t L = 0, reps = 0, tail_rows = 0, rows = 0;
  int64_t block_chunk = 1, tail_chunk = 1;  // rows per chunk (sign rows of L values; tail rows)
  int64_t block_chunks = 0, tail_chunks = 0;
  // Q's L x L values fit in one chunk: the sign rows are read in place and z (forward) or the sum over
  // sign rows (backward) goes with Q into one L x L buffer, instead of a chunk-sized one per thread.
  bool small_block = false;
  int64_t chunks() const { return block_chunks + tail_chunks; }
};

// sum(x[0, n)) in double: eight lane sums (x[8 k + l] into lane l), then the lanes and the tail in order.
// One double chain per element (the loop before) ran at one add per four cycles, an eighth of the MLP's
// mapped step; the lanes vectorise. The order is fixed by n alone.
double sum_in_lanes(const float* x, int64_t n) {
  double lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += static_cast<double>(x[i + l]);
  double total = 0;
  for (double lane : lanes) total += lane;
  for (; i < n; ++i) total += static_cast<double>(x[i]);
  return total;
}

void check_f32(const char* op, const char* name, const Tensor& t, std::initializer_list<int64_t> sizes) {
  bool ok = t.dtype() == DType::f32 && t.is_contiguous() && t.dim() == static_cast<int64_t>(sizes.size());
  std::string expected = "[";
  int d = 0;
  for (int64_t n : sizes) {
    ok = ok && t.size(d) == n;
    expected += (d++ ? ", " : "") + std::to_string(n);
  }
  MN_CHECK(ok, ValueError, op, ": expected ", name, " as a contiguous f32 tensor of shape ", expected, "], got ",
           t.dtype(), t.sizes());
}

GroupShape shape_of(const char* op, const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
               const Tensor& z, int64_t out_rows) {
  MN_CHECK(tail.defined() && tail.dim() == 2 && z.defined() && z.dim() == 1, ValueError, op,
           ": expected a 2-D tail and a 1-D latent, got ", tail.defined() ? tail.sizes().str() : "undefined", " and ",
           z.defined() ? z.sizes().str() : "undefined");
  MN_CHECK(block.defined() == signs.defined(), ValueError, op, ": block and signs come together");
  GroupShape s;
  s.L = z.size(0);
  s.reps = signs.defined() ? signs.size(0) : 0;
  s.tail_rows = tail.size(0);
  s.rows = s.reps * s.L + s.tail_rows;
  check_f32(op, "z", z, {s.L});
  check_f32(op, "tail", tail, {s.tail_rows, s.L});
  if (block.defined()) {
    check_f32(op, "block", block, {s.L, s.L});
    check_f32(op, "signs", signs, {s.reps, s.L});
  }
  if (scale.defined()) check_f32(op, "scale", scale, {s.rows});
  MN_CHECK(out_rows == s.rows, ValueError, op, ": W has ", s.rows, " rows, the generated vector ", out_rows);
  s.block_chunk = std::max<int64_t>(1, kChunkFloats / s.L);
  s.tail_chunk = std::max<int64_t>(8, kChunkFloats / s.L);
  s.block_chunks = (s.reps + s.block_chunk - 1) / s.block_chunk;
  s.tail_chunks = (s.tail_rows + s.tail_chunk - 1) / s.tail_chunk;
  s.small_block = s.block_chunks > 0 && s.L <= std::min(s.reps, s.block_chunk);
  return s;
}

// Threads for `chunks` chunks of `work` multiply-adds in all: one inside a parallel region.
int team_for(int64_t chunks, int64_t work) {
  if (omp_in_parallel() || work < kSerialWork) return 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(get_num_threads_in_use(), chunks)));
}

// alpha * sum(z^2), summed in double in index order.
float modulation_term(double alpha, const float* z, int64_t n) {
  if (alpha == 0) return 0.0f;
  double sq = 0;
  for (int64_t i = 0; i < n; ++i) sq += static_cast<double>(z[i]) * z[i];
  return static_cast<float>(alpha * sq);
}

// y = (y + c) * scale over n values (scale null: 1): the epilogue of every chunk.
void epilogue(float* y, const float* scale, float c, int64_t n) {
  if (scale) {
    for (int64_t i = 0; i < n; ++i) y[i] = (y[i] + c) * scale[i];
  } else if (c != 0.0f) {
    for (int64_t i = 0; i < n; ++i) y[i] += c;
  }
}

// A range of the forward's output rows computed by one product: sign rows [begin, end) of the repeated
// part, or rows [begin, end) of the tail.
struct Item {
  enum Kind { kTail, kSignRows, kBlocked } kind;  // kBlocked: sign rows multiplied K block by K block
  int64_t begin, end;
};

// n rows cut into `pieces` near-equal ranges of kind `kind`.
void cut_rows(std::vector<Item>& items, Item::Kind kind, int64_t n, int64_t pieces) {
  for (int64_t p = 0; p < pieces; ++p) items.push_back({kind, n * p / pieces, n * (p + 1) / pieces});
}

// The forward's products. Tail rows keep the shape's chunks (their matrix-vector products run on Eigen).
// Sign rows keep them too unless the packed GEMM takes them (enabled, and L >= 16 columns): every output
// row is then a chain of sums of its own, so they are cut into ranges balanced over the team, whatever
// the cut, with the same bits; only a last chunk of one to three rows keeps its own (Eigen) product. With
// a large block those ranges run K block by K block of Q^T (kBlocked), each block packed once per thread
// for all of that thread's ranges, instead of once per chunk.
std::vector<Item> forward_items(const GroupShape& s, int team, bool packed) {
  std::vector<Item> items;
  for (int64_t r0 = 0; r0 < s.tail_rows; r0 += s.tail_chunk)
    items.push_back({Item::kTail, r0, std::min(s.tail_rows, r0 + s.tail_chunk)});
  int64_t free_rows = 0;  // sign rows [0, free_rows) may be cut freely
  if (packed && s.block_chunks > 0 && s.block_chunk >= 4) {  // chunks below 4 rows went to Eigen
    const int64_t last = s.reps - (s.block_chunks - 1) * s.block_chunk;
    free_rows = last < 4 ? s.reps - last : s.reps;
  }
  if (free_rows > 0) {
    const int64_t pieces = std::max((free_rows + s.block_chunk - 1) / s.block_chunk,
                                    std::min<int64_t>(2 * team, free_rows / 8));
    cut_rows(items, s.small_block ? Item::kSignRows : Item::kBlocked, free_rows, std::max<int64_t>(1, pieces));
  }
  for (int64_t b0 = free_rows; b0 < s.reps; b0 += s.block_chunk)
    items.push_back({Item::kSignRows, b0, std::min(s.reps, b0 + s.block_chunk)});
  return items;
}

void mapped_group_forward_cpu(const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
                              double alpha, const Tensor& z, Tensor& out) {
  const GroupShape s = shape_of("mapped_group_forward", block, signs, tail, scale, z, out.numel());
  MN_CHECK(out.dtype() == DType::f32 && out.is_contiguous(), ValueError,
           "mapped_group_forward: expected a contiguous f32 output, got ", out.dtype(), out.sizes());
  const int64_t L = s.L;
  const float* zp = z.data<float>();
  const float* sp = scale.defined() ? scale.data<float>() : nullptr;
  const float c = modulation_term(alpha, zp, L);
  float* y = out.data<float>();
  const int team = team_for(s.chunks() + s.reps / 8, s.rows * L);  // sign rows are cut down to 8 a piece
  const bool packed = cpu::packed_gemm_enabled() && cpu::packed_gemm_suits(4, L, L);
  const std::vector<Item> items = forward_items(s, team, packed);
  const float* sg = signs.defined() ? signs.data<float>() : nullptr;
  const float* qp = block.defined() ? block.data<float>() : nullptr;
  // Row b of the repeated part is (s_b * z) Q^T = s_b (z * Q)^T. Small blocks: one [L, L] buffer of
  // z * Q (Q's columns times z), the sign rows read in place. Otherwise sign products s_b * z in a buffer
  // per thread: of whole rows for kSignRows, of one K block's columns for kBlocked. The products are the
  // same floats either way (a sign flip is exact).
  std::vector<size_t> blocked;  // the kBlocked items
  int64_t per_thread = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].kind == Item::kBlocked) blocked.push_back(i);
    if (items[i].kind == Item::kSignRows && !s.small_block)
      per_thread = std::max(per_thread, (items[i].end - items[i].begin) * L);
  }
  const std::vector<cpu::GemmBBlock> blocks = blocked.empty() ? std::vector<cpu::GemmBBlock>{} : cpu::gemm_b_blocks(L, L);
  int64_t block_floats = 0, max_kc = 0;
  for (const cpu::GemmBBlock& b : blocks) {
    block_floats = std::max(block_floats, b.floats());
    max_kc = std::max(max_kc, b.kc);
  }
  for (size_t i : blocked) per_thread = std::max(per_thread, (items[i].end - items[i].begin) * max_kc);
  Tensor buffers = empty({std::max<int64_t>(1, s.small_block ? L * L : team * per_thread)});
  float* buffer_base = buffers.data<float>();
  if (s.small_block) {
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < L; ++j) buffer_base[i * L + j] = qp[i * L + j] * zp[j];
  }
  const MatrixRef q_t{s.small_block ? buffer_base : qp, L, L, 1, L};  // Q^T, or (z * Q)^T
  const MatrixRef z_col{zp, L, 1, 1, 1};
  const float* tp = tail.data<float>();
  const int64_t repeated = s.reps * L;
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(team)
  {
    float* products = buffer_base + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t i = 0; i < n_items; ++i) {
      const Item& item = items[static_cast<size_t>(i)];
      if (item.kind == Item::kTail) {
        float* yc = y + repeated + item.begin;
        cpu::gemm_serial(MatrixRef{tp + item.begin * L, item.end - item.begin, L, L, 1}, z_col, yc, 1, 1.0f, 0.0f);
        epilogue(yc, sp ? sp + repeated + item.begin : nullptr, c, item.end - item.begin);
      } else if (item.kind == Item::kSignRows) {
        const int64_t n = item.end - item.begin;
        const float* a = sg + item.begin * L;
        if (!s.small_block) {
          for (int64_t b = 0; b < n; ++b)
            for (int64_t j = 0; j < L; ++j) products[b * L + j] = a[b * L + j] * zp[j];
          a = products;
        }
        float* yc = y + item.begin * L;
        cpu::gemm_serial(MatrixRef{a, n, L, L, 1}, q_t, yc, L, 1.0f, 0.0f);
        epilogue(yc, sp ? sp + item.begin * L : nullptr, c, n * L);
      }
    }
    // Blocked ranges, dealt round-robin: each thread packs every K block of Q^T once into its own GEMM
    // packing buffer (read from its own cache; no barrier) and multiplies its ranges by it.
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (t < static_cast<int>(blocked.size())) {
      cpu::LentBBuffer own(block_floats);
      for (const cpu::GemmBBlock& blk : blocks) {
        cpu::pack_b_block(q_t, blk, own.data());
        const bool last_k = blk.pc + blk.kc == L;
        for (size_t r = static_cast<size_t>(t); r < blocked.size(); r += static_cast<size_t>(nt)) {
          const Item& item = items[blocked[r]];
          const int64_t n = item.end - item.begin;
          for (int64_t b = 0; b < n; ++b) {
            const float* row = sg + (item.begin + b) * L + blk.pc;
            for (int64_t k = 0; k < blk.kc; ++k) products[b * blk.kc + k] = row[k] * zp[blk.pc + k];
          }
          float* yc = y + item.begin * L;
          cpu::multiply_b_block(products, blk.kc, 1, n, own.data(), blk, yc, L, 1.0f, 0.0f);
          if (last_k)
            for (int64_t b = 0; b < n; ++b)
              epilogue(yc + b * L + blk.jc, sp ? sp + (item.begin + b) * L + blk.jc : nullptr, c, blk.nc);
        }
      }
    }
  }
}

void mapped_group_backward_cpu(const Tensor& block, const Tensor& signs, const Tensor& tail, const Tensor& scale,
                               double alpha, const Tensor& z, const Tensor& grad, Tensor& grad_z) {
  const GroupShape s = shape_of("mapped_group_backward", block, signs, tail, scale, z, grad.numel());
  MN_CHECK(grad.dtype() == DType::f32 && grad.is_contiguous() && grad_z.dtype() == DType::f32 &&
               grad_z.is_contiguous() && grad_z.numel() == s.L,
           ValueError, "mapped_group_backward: expected a contiguous f32 gradient of ", s.rows,
           " values and a contiguous f32 result of ", s.L, ", got ", grad.dtype(), grad.sizes(), " and ",
           grad_z.dtype(), grad_z.sizes());
  const int64_t L = s.L, chunks = s.chunks();
  const float* zp = z.data<float>();
  const float* sp = scale.defined() ? scale.data<float>() : nullptr;
  const float* g = grad.data<float>();
  const float* sg = signs.defined() ? signs.data<float>() : nullptr;
  const float* tp = tail.data<float>();
  const int team = team_for(chunks, s.rows * L);
  // Per thread: the scaled gradient u = scale * grad of a chunk (with scales only), and the product
  // buffer: U Q for a block chunk ([rows, L]; small blocks: S^T U, [L, L]) or the tail's T^T u; per
  // chunk: its partial of W^T u and of sum(u).
  const int64_t chunk_values = std::max(s.block_chunks > 0 ? std::min(s.reps, s.block_chunk) * L : 0,
                                        s.tail_chunks > 0 ? std::min(s.tail_rows, s.tail_chunk) : 0);
  const int64_t u_values = sp ? chunk_values : 0;
  const int64_t per_thread = u_values + std::max(s.small_block ? L * L : chunk_values, L);
  Tensor buffers = empty({team * per_thread});
  float* buffer_base = buffers.data<float>();
  std::vector<double> partial(static_cast<size_t>(chunks * L), 0.0), partial_sum(static_cast<size_t>(chunks), 0.0);
  const float* qp = block.defined() ? block.data<float>() : nullptr;
  const MatrixRef q{qp, L, L, L, 1};
  const int64_t repeated = s.reps * L;
  // Work items: whole chunks, and for small blocks the K blocks of some chunks. The packed GEMM sums a
  // chunk's S^T U K block by K block (gemm_b_blocks: each block a chain from zero, added to the result in
  // order), so the blocks can run apart and be added in that order afterwards, the same bits. Where the
  // full chunks do not divide evenly over the team (MLP fc2 at L = 64: one chunk of 1,024 sign rows and
  // one of 4; fc1: three and one of 68), the last full chunks left over are cut so: their K blocks
  // balance the team's last round. Their [L, L] results: fewer than team chunks' K blocks, about
  // team x 256 L floats (small blocks have L <= 256: at most 256 KB a thread).
  struct Work {
    int64_t chunk, pc = 0, kc = 0;  // kc > 0: K block [pc, pc + kc) of a cut chunk
    int64_t slot = -1;              // its [L, L] result in `cut_r`; -1: a whole chunk
  };
  std::vector<Work> items;
  std::vector<std::vector<Work>> cut_blocks;  // each cut chunk's K blocks, in order
  const int64_t full_chunks = s.reps / s.block_chunk;
  const bool cut = s.small_block && team > 1 && cpu::packed_gemm_enabled() && cpu::packed_gemm_suits(L, L, s.block_chunk) &&
                   full_chunks % team != 0 && s.block_chunk > 1;
  int64_t slots = 0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const bool cut_this = cut && chunk < full_chunks && chunk >= full_chunks - full_chunks % team;
    if (!cut_this) {
      items.push_back({chunk});
      continue;
    }
    cut_blocks.emplace_back();
    for (const cpu::GemmBBlock& b : cpu::gemm_b_blocks(s.block_chunk, L)) cut_blocks.back().push_back({chunk, b.pc, b.kc, slots++});
  }
  for (const std::vector<Work>& blocks : cut_blocks) items.insert(items.end(), blocks.begin(), blocks.end());
  Tensor cut_results = slots > 0 ? empty({slots * L * L}) : Tensor();  // through the allocator: peaks count it
  float* cut_r = slots > 0 ? cut_results.data<float>() : nullptr;
  // acc[j] = sum_i Q_ij R_ji in double, i in order: a small block's share of W^T u from R = S^T U.
  auto q_times_r = [&](const float* r_all, double* acc) {
    for (int64_t j = 0; j < L; ++j) {
      double v = 0;
      const float* r = r_all + j * L;
      for (int64_t i = 0; i < L; ++i) v += static_cast<double>(qp[i * L + j] * r[i]);
      acc[j] = v;
    }
  };
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
  for (int64_t it = 0; it < n_items; ++it) {
    const Work& item = items[static_cast<size_t>(it)];
    const int64_t chunk = item.chunk;
    float* u = buffer_base + omp_get_thread_num() * per_thread;
    float* p = u + u_values;
    double* acc = partial.data() + chunk * L;
    const bool in_block = chunk < s.block_chunks;
    const int64_t first = in_block ? chunk * s.block_chunk * L : repeated + (chunk - s.block_chunks) * s.tail_chunk;
    const int64_t count = in_block ? (std::min(s.reps, (chunk + 1) * s.block_chunk) - chunk * s.block_chunk) * L
                                   : std::min(s.tail_chunk, s.rows - first);
    if (item.slot >= 0) {
      // K block [pc, pc + kc) of a cut chunk: its rows of u (the first block: all of them, and their sum).
      const int64_t b0 = chunk * s.block_chunk, k0 = item.pc * L, kn = item.pc == 0 ? count : item.kc * L;
      const float* ub = g + first + k0;
      if (sp) {
        for (int64_t i = 0; i < kn; ++i) u[i] = g[first + k0 + i] * sp[first + k0 + i];
        ub = u;
      }
      if (item.pc == 0) partial_sum[static_cast<size_t>(chunk)] = sum_in_lanes(ub, count);
      cpu::gemm_serial(MatrixRef{sg + (b0 + item.pc) * L, L, item.kc, 1, L}, MatrixRef{ub, item.kc, L, L, 1},
                       cut_r + item.slot * L * L, L, 1.0f, 0.0f);
      continue;
    }
    // u = scale * grad of this chunk (the gradient itself without scales), and its sum.
    const float* uc = g + first;
    if (sp) {
      for (int64_t i = 0; i < count; ++i) u[i] = g[first + i] * sp[first + i];
      uc = u;
    }
    partial_sum[static_cast<size_t>(chunk)] = sum_in_lanes(uc, count);
    if (in_block && s.small_block) {
      // sum_b s_bj (Q^T u_b)_j = sum_i Q_ij R_ji with R = S^T U ([L, L]): the sign rows read in place.
      const int64_t n = count / L, b0 = chunk * s.block_chunk;
      cpu::gemm_serial(MatrixRef{sg + b0 * L, L, n, 1, L}, MatrixRef{uc, n, L, L, 1}, p, L, 1.0f, 0.0f);
      q_times_r(p, acc);
    } else if (in_block) {
      // Sign row b's share of W^T u is s_b * (Q^T u_b): P = U Q, then each column weighted by its signs.
      const int64_t n = count / L, b0 = chunk * s.block_chunk;
      cpu::gemm_serial(MatrixRef{uc, n, L, L, 1}, q, p, L, 1.0f, 0.0f);
      for (int64_t b = 0; b < n; ++b) {
        const float* row = p + b * L;
        const float* sr = sg + (b0 + b) * L;
        for (int64_t j = 0; j < L; ++j) acc[j] += static_cast<double>(sr[j] * row[j]);
      }
    } else {
      // T_chunk^T u_chunk, [L, count] x [count, 1].
      float* t = p;
      const int64_t r0 = first - repeated;
      cpu::gemm_serial(MatrixRef{tp + r0 * L, L, count, 1, L}, MatrixRef{uc, count, 1, 1, 1}, t, 1, 1.0f, 0.0f);
      for (int64_t j = 0; j < L; ++j) acc[j] = t[j];
    }
  }
  // The cut chunks: R = ((R_0 + R_1) + R_2) + ..., each add a float add as the packed kernel's.
  for (const std::vector<Work>& blocks : cut_blocks) {
    float* r = cut_r + blocks.front().slot * L * L;
    for (size_t b = 1; b < blocks.size(); ++b) {
      const float* rb = cut_r + blocks[b].slot * L * L;
      for (int64_t i = 0; i < L * L; ++i) r[i] = r[i] + rb[i];
    }
    q_times_r(r, partial.data() + blocks.front().chunk * L);
  }
  double total = 0;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) total += partial_sum[static_cast<size_t>(chunk)];
  float* out = grad_z.data<float>();
  for (int64_t j = 0; j < L; ++j) {
    double v = 0;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) v += partial[static_cast<size_t>(chunk * L + j)];
    out[j] = static_cast<float>(v + 2.0 * alpha * total * zp[j]);
  }
}

}  // namespace

void register_cpu_mapped_group() {
  mapped_group_forward.set(DeviceType::CPU, &mapped_group_forward_cpu);
  mapped_group_backward.set(DeviceType::CPU, &mapped_group_backward_cpu);
}

}  // namespace mn::kernels
