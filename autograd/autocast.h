#pragma once
// Automatic mixed precision: a scope in which the ops that gain from 16-bit math run in bf16 or f16 and
// the ones that lose precision run in f32, PyTorch's torch.autocast in C++:
//
//   {
//     mn::autocast scope(mn::kCPU, mn::DType::bf16);   // or (Device::cuda(0), DType::f16)
//     Tensor loss = nn::functional::cross_entropy(model.forward(x), y);
//   }
//   loss.backward();   // gradients arrive in each leaf's own dtype (f32 parameters stay f32)
//
// Inside the scope, for tensors on the scope's device type:
//   lower precision  matmul, mm, bmm, linear, conv2d: floating inputs are cast to the scope's dtype
//                    (their products accumulate in f32) and the result has that dtype;
//   f32              softmax, log_softmax, every loss, layer_norm, group_norm, batch_norm: 16-bit
//                    inputs are cast up to f32 first, and the result is f32;
//   everything else  runs in its inputs' dtype, two floating dtypes promoting to the wider (bf16 + f32
//                    is f32).
// Casts are differentiable, so gradients flow back through them; within one scope (the outermost one
// on this thread), the lower-precision copy of a leaf that requires grad (a weight) is made once and
// reused until the leaf changes in place. Backward passes run with autocast off, whatever scope is
// open. Scopes nest; a scope with enabled = false turns autocast off inside an enabled one.
#include "core/device.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace mn {

class autocast {
 public:
  // dtype: bf16 or f16 (ValueError otherwise).
  autocast(DeviceType device_type, DType dtype, bool enabled = true);
  autocast(Device device, DType dtype, bool enabled = true) : autocast(device.type, dtype, enabled) {}
  ~autocast();
  autocast(const autocast&) = delete;
  autocast& operator=(const autocast&) = delete;

 private:
  DeviceType device_type_;
  bool previous_enabled_;
  DType previous_dtype_;
};

bool is_autocast_enabled(DeviceType device_type);
// The dtype a scope on device_type casts to (bf16 on the CPU and f16 on CUDA until a scope sets one).
DType autocast_dtype(DeviceType device_type);

namespace amp {
// The casts the op lists above apply; the ops call them on entry. Outside an enabled scope for the
// tensor's device type (or on an undefined or i64 tensor) they return their argument.
Tensor cast_lower(const Tensor& t);  // to the scope's 16-bit dtype (cached for leaves needing grad)
Tensor cast_f32(const Tensor& t);    // a 16-bit tensor up to f32

// Turns autocast off on this thread for its lifetime (the engine runs backward passes under one).
class AutocastOff {
 public:
  AutocastOff();
  ~AutocastOff();
  AutocastOff(const AutocastOff&) = delete;
  AutocastOff& operator=(const AutocastOff&) = delete;

 private:
  bool saved_[kNumDeviceTypes];
};
}  // namespace amp

}  // namespace mn
