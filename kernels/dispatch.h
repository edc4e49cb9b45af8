#pragma once
// The op table: one slot per device type for each kernel. Backends fill their slots in an explicit
// registration function (static initialisers are unreliable inside static libraries); the first
// lookup of an empty slot runs registration once and then reports a missing kernel clearly.
// Slots are atomics: a thread on the fast path may read a slot while another thread's first lookup
// is still filling the table inside call_once (the acquire load pairs with set()'s release store, so
// a non-null slot also shows the kernel's registration complete).
//
// 16-bit floats (bf16, f16) reach every kernel through one mechanism: a kernel registered without
// `reduced_precision` never sees them. When an argument is a bf16/f16 tensor, the call widens it into
// an f32 copy, runs the f32 kernel, and rounds each written output (the kernel signature's non-const
// `Tensor&` parameters) back into the caller's tensor; outputs are widened first too, since some
// kernels accumulate into them. Kernels that handle 16-bit data themselves (copy, the GEMMs on CUDA)
// say so when registered.
#include <array>
#include <atomic>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/capture.h"
#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"

namespace mn::kernels {

void ensure_registered();  // runs every backend's registration once

namespace lowp {
// A contiguous f32 copy of a bf16/f16 tensor on its device, and the rounding copy back (dispatch.cpp).
Tensor widen(const Tensor& t);
void narrow_into(const Tensor& wide, Tensor& target);

inline bool is_reduced(const Tensor& t) { return t.defined() && is_reduced_precision(t.dtype()); }
template <class A>
bool any_reduced(const A& a) {
  if constexpr (std::is_same_v<std::decay_t<A>, Tensor>) return is_reduced(a);
  else return false;
}

template <class Fn> struct Params;
template <class R, class... P> struct Params<R(P...)> {
  using type = std::tuple<P...>;
  using result = R;
};

// An argument as the widened call holds it: tensors by value (the f32 copy or the caller's handle),
// everything else as it came.
template <class A>
using Held = std::conditional_t<std::is_same_v<std::decay_t<A>, Tensor>, Tensor, A>;

// Param is the kernel signature's parameter type at this position: `Tensor&` marks an output.
template <class Param, class A>
Held<A> hold(A&& a, std::vector<std::pair<Tensor, Tensor>>& written) {
  if constexpr (std::is_same_v<std::decay_t<A>, Tensor>) {
    if (!is_reduced(a)) return a;
    Tensor wide = widen(a);
    if constexpr (std::is_same_v<Param, Tensor&>) written.emplace_back(a, wide);
    return wide;
  } else {
    return std::forward<A>(a);
  }
}
}  // namespace lowp

template <class Fn>
class Op {
 public:
  explicit constexpr Op(const char* name) : name_(name) {}
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  // reduced_precision: the kernel takes bf16/f16 tensors itself (else the call widens them to f32).
  void set(DeviceType type, Fn* fn, bool reduced_precision = false) {
    native_reduced_[static_cast<int>(type)].store(reduced_precision, std::memory_order_relaxed);
    slot(type).store(fn, std::memory_order_release);
  }
  bool has(DeviceType type) const { return slot(type).load(std::memory_order_acquire) != nullptr; }
  const char* name() const { return name_; }

  using Result = typename lowp::Params<Fn>::result;

  template <class... A>
  Result operator()(Device device, A&&... args) const {
    Fn* fn = slot(device.type).load(std::memory_order_acquire);
    if (fn == nullptr) fn = resolve(device);
    if ((lowp::any_reduced(args) || ...) &&
        !native_reduced_[static_cast<int>(device.type)].load(std::memory_order_relaxed))
      return call_widened(std::index_sequence_for<A...>{}, device, std::forward<A>(args)...);
    // While a graph is being recorded, the call also becomes one of its steps (core/capture.h).
    if (capture::detail::t_recording != nullptr)
      return capture::detail::record_kernel(fn, std::forward<A>(args)...);
    return fn(std::forward<A>(args)...);
  }

 private:
  // Runs the f32 kernel on widened copies and rounds the written outputs back (see the file comment).
  // Goes through operator() again, so a recording captures the widening copies with the kernel.
  template <size_t... I, class... A>
  Result call_widened(std::index_sequence<I...>, Device device, A&&... args) const {
    using P = typename lowp::Params<Fn>::type;
    std::vector<std::pair<Tensor, Tensor>> written;
    std::tuple<lowp::Held<A>...> held(lowp::hold<std::tuple_element_t<I, P>>(std::forward<A>(args), written)...);
    auto finish = [&] {
      for (auto& [target, wide] : written) lowp::narrow_into(wide, target);
    };
    if constexpr (std::is_void_v<Result>) {
      std::apply([this, device](auto&... a) { (*this)(device, a...); }, held);
      finish();
    } else {
      auto result = std::apply([this, device](auto&... a) { return (*this)(device, a...); }, held);
      finish();
      return result;
    }
  }

  Fn* resolve(Device device) const {
    ensure_registered();
    Fn* fn = slot(device.type).load(std::memory_order_acquire);
    MN_CHECK(fn != nullptr, NotImplementedError, "kernel '", name_, "' is not implemented for device ",
             device.str(), device.is_cuda() ? " (this build has no CUDA backend)" : "");
    return fn;
  }
  std::atomic<Fn*>& slot(DeviceType type) { return impl_[static_cast<int>(type)]; }
  const std::atomic<Fn*>& slot(DeviceType type) const { return impl_[static_cast<int>(type)]; }
  const char* name_;
  std::array<std::atomic<Fn*>, kNumDeviceTypes> impl_{};
  std::array<std::atomic<bool>, kNumDeviceTypes> native_reduced_{};
};

}  // namespace mn::kernels
