#pragma once
// What both backends' adaptive pooling kernels (kernels/cpu/adaptive_pool.cpp,
// kernels/cuda/adaptive_pool.cu) share: the plane sizes, checked on the host, and PyTorch's windows.
#include <cstdint>

#include "core/error.h"
#include "core/host_device.h"
#include "core/shape.h"

namespace mn::kernels {

struct AdaptivePlanes {
  int64_t planes, height, width, out_h, out_w;
};

// in and out are [N, C, H, W] and [N, C, OH, OW] with non-empty planes.
inline AdaptivePlanes adaptive_planes(const Shape& in, const Shape& out, const char* op) {
  MN_CHECK(in.size() == 4 && out.size() == 4 && in[0] == out[0] && in[1] == out[1], ValueError, op,
           " kernel: expected [N, C, H, W] input and output with equal N and C, got ", in, " and ", out);
  MN_CHECK(in[2] > 0 && in[3] > 0 && out[2] > 0 && out[3] > 0, ValueError, op,
           " kernel: expected non-empty input and output planes, got ", in, " and ", out);
  return {in[0] * in[1], in[2], in[3], out[2], out[3]};
}

// Output i of `out` covers inputs window_start .. window_end - 1 of `in`: floor(i*in/out) to
// ceil((i+1)*in/out).
MN_HOST_DEVICE inline int64_t window_start(int64_t i, int64_t in, int64_t out) { return i * in / out; }
MN_HOST_DEVICE inline int64_t window_end(int64_t i, int64_t in, int64_t out) { return ((i + 1) * in + out - 1) / out; }

}  // namespace mn::kernels
