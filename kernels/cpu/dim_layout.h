#pragma once
// Layout helpers for CPU kernels that walk along dimensions (reductions, softmax, indexing): a dense
// copy of an input when its strides are irregular and the [outer, n, inner] split around one dim (the
// rule deciding when a loop is worth handing to OpenMP, and to how many threads, is parallel_team in
// loops.h). Work is always divided into pieces chosen from the shapes alone, so results never depend
// on the thread count.
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cpu/loops.h"
#include "kernels/dim_split.h"
#include "kernels/kernels.h"

namespace mn::kernels::cpu {

// t itself when contiguous, else a contiguous copy (no autograd history).
inline Tensor dense(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty(t.sizes(), t.options());
  copy(t.device(), t, out);
  return out;
}

using kernels::DimSplit;  // kernels/dim_split.h
using kernels::split_at;

// Kernels get their outputs from the op layer; a non-contiguous one is a programming error there.
inline void require_contiguous_output(const Tensor& out, const char* kernel, const char* arg) {
  MN_CHECK(out.is_contiguous(), ValueError, kernel, ": output '", arg, "' must be contiguous, got shape ",
           out.sizes(), " with strides ", out.strides());
}

}  // namespace mn::kernels::cpu
