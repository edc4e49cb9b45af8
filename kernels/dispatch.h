#pragma once
// The op table: one slot per device type for each kernel. Backends fill their slots in an explicit
// registration function (static initialisers are unreliable inside static libraries); the first
// lookup of an empty slot runs registration once and then reports a missing kernel clearly.
// Slots are atomics: a thread on the fast path may read a slot while another thread's first lookup
// is still filling the table inside call_once (the acquire load pairs with set()'s release store, so
// a non-null slot also shows the kernel's registration complete).
#include <array>
#include <atomic>
#include <utility>

#include "core/capture.h"
#include "core/device.h"
#include "core/error.h"

namespace mn::kernels {

void ensure_registered();  // runs every backend's registration once

template <class Fn>
class Op {
 public:
  explicit constexpr Op(const char* name) : name_(name) {}
  Op(const Op&) = delete;
  Op& operator=(const Op&) = delete;
  void set(DeviceType type, Fn* fn) { slot(type).store(fn, std::memory_order_release); }
  bool has(DeviceType type) const { return slot(type).load(std::memory_order_acquire) != nullptr; }
  const char* name() const { return name_; }

  template <class... A>
  decltype(auto) operator()(Device device, A&&... args) const {
    Fn* fn = slot(device.type).load(std::memory_order_acquire);
    if (fn == nullptr) fn = resolve(device);
    // While a graph is being recorded, the call also becomes one of its steps (core/capture.h).
    if (capture::detail::t_recording != nullptr)
      return capture::detail::record_kernel(fn, std::forward<A>(args)...);
    return fn(std::forward<A>(args)...);
  }

 private:
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
};

}  // namespace mn::kernels
