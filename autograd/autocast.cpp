#include "autograd/autocast.h"

#include <unordered_map>

#include "autograd/node.h"
#include "autograd/ops.h"

namespace mn {

namespace {

struct DeviceState {
  bool enabled = false;
  DType dtype;
};

// The lower-precision copy of a leaf weight made in this thread's outermost scope: reused while the
// leaf's version is unchanged. `source` keeps the leaf alive so its address cannot be reused.
struct CachedCast {
  Tensor source;
  uint32_t version;
  Tensor cast;
};

struct ThreadState {
  DeviceState device[kNumDeviceTypes] = {{false, DType::bf16}, {false, DType::f16}};
  int scopes = 0;  // open autocast objects on this thread
  std::unordered_map<const TensorImpl*, CachedCast> cache;
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

DeviceState& device_state(DeviceType type) { return state().device[static_cast<int>(type)]; }

bool applies_to(const Tensor& t) {
  return t.defined() && is_floating_point(t.dtype()) && device_state(t.device().type).enabled;
}

}  // namespace

autocast::autocast(DeviceType device_type, DType dtype, bool enabled) : device_type_(device_type) {
  MN_CHECK(is_reduced_precision(dtype), ValueError, "autocast: expected dtype bf16 or f16, got ", dtype);
  DeviceState& s = device_state(device_type);
  previous_enabled_ = s.enabled;
  previous_dtype_ = s.dtype;
  s.enabled = enabled;
  s.dtype = dtype;
  ++state().scopes;
}

autocast::~autocast() {
  DeviceState& s = device_state(device_type_);
  s.enabled = previous_enabled_;
  s.dtype = previous_dtype_;
  if (--state().scopes == 0) state().cache.clear();
}

bool is_autocast_enabled(DeviceType device_type) { return device_state(device_type).enabled; }
DType autocast_dtype(DeviceType device_type) { return device_state(device_type).dtype; }

namespace amp {

Tensor cast_lower(const Tensor& t) {
  if (!applies_to(t)) return t;
  const DType target = device_state(t.device().type).dtype;
  if (t.dtype() == target) return t;
  // Weights (leaves that need gradients) are cast once per outermost scope, as long as grad mode
  // records the cast; anything else (activations, generated parameters) is cast where it is used.
  const bool cacheable = t.is_leaf() && t.requires_grad() && autograd::grad_mode_enabled();
  if (!cacheable) return to_dtype(t, target);
  auto& cache = state().cache;
  auto it = cache.find(t.impl());
  if (it != cache.end() && it->second.version == t.version() && it->second.cast.dtype() == target)
    return it->second.cast;
  Tensor cast = to_dtype(t, target);
  cache[t.impl()] = CachedCast{t, t.version(), cast};
  return cast;
}

Tensor cast_f32(const Tensor& t) {
  if (!applies_to(t) || t.dtype() == DType::f32) return t;
  return to_dtype(t, DType::f32);
}

AutocastOff::AutocastOff() {
  for (int i = 0; i < kNumDeviceTypes; ++i) {
    saved_[i] = state().device[i].enabled;
    state().device[i].enabled = false;
  }
}

AutocastOff::~AutocastOff() {
  for (int i = 0; i < kNumDeviceTypes; ++i) state().device[i].enabled = saved_[i];
}

}  // namespace amp

}  // namespace mn
