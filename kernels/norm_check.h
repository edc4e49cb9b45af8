#pragma once
// The argument check the row_norm kernels of both backends share (kernels/cpu/norm.cpp,
// kernels/cuda/norm.cu).
#include "kernels/kernels.h"

namespace mn::kernels {

// ValueError unless the layout covers x exactly and weight (when defined) has s.channels() entries.
inline void check_row_norm_layout(const RowNormLayout& s, const Tensor& x, const Tensor& weight, const char* kernel) {
  MN_CHECK(s.rows >= 0 && s.row_len >= 0 && s.groups >= 1 && s.inner >= 1 && s.rows % s.groups == 0 &&
               s.row_len % s.inner == 0 && s.rows * s.row_len == x.numel(),
           ValueError, kernel, ": layout rows ", s.rows, " x ", s.row_len, " (groups ", s.groups, ", inner ", s.inner,
           ") does not fit x of shape ", x.sizes());
  MN_CHECK(!weight.defined() || weight.numel() == s.channels(), ValueError, kernel, ": expected ", s.channels(),
           " affine entries, got weight of shape ", weight.sizes());
}

}  // namespace mn::kernels
