#pragma once
// A contiguous tensor seen as [outer, n, inner] around one dim: the layout that kernels walking along
// a dimension (softmax, indexing, reductions) use on every device.
#include <cstdint>

#include "core/shape.h"

namespace mn::kernels {

struct DimSplit {
  int64_t outer = 1, n = 1, inner = 1;
};

inline DimSplit split_at(const Shape& sizes, int dim) {
  DimSplit s;
  for (int d = 0; d < sizes.size(); ++d) {
    if (d < dim)
      s.outer *= sizes[d];
    else if (d == dim)
      s.n = sizes[d];
    else
      s.inner *= sizes[d];
  }
  return s;
}

}  // namespace mn::kernels
