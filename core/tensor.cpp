// Tensor metadata, allocation (empty, make_view), element access, printing, and the autograd state
// core can read. Methods that create views or copies or change autograd state forward to the autograd
// layer through core/tensor_hooks.h; the kernel-backed factories live in kernels/factories.cpp.
#include "core/tensor.h"

#include <cmath>
#include <cstdio>
#include <new>
#include <sstream>

#include "core/capture.h"
#include "core/tensor_hooks.h"

namespace mn {

TensorImpl::TensorImpl() = default;
TensorImpl::~TensorImpl() { delete autograd.load(std::memory_order_acquire); }

namespace {

// No machine addresses more (x86-64 and CUDA both stop below 2^49): a larger request is a mistake in the
// shape, not an allocation to try.
constexpr int64_t kMaxTensorBytes = int64_t{1} << 48;

// Bytes of a contiguous tensor of `shape`; ValueError naming the shape when it overflows or passes the cap.
size_t contiguous_bytes(const Shape& shape, DType dtype) {
  for (int64_t s : shape) MN_CHECK(s >= 0, ValueError, "negative dimension in shape ", shape);
  int64_t bytes = 0;
  const bool overflow = mul_overflows(shape.numel(), static_cast<int64_t>(dtype_size(dtype)), &bytes);
  MN_CHECK(!overflow && bytes <= kMaxTensorBytes, ValueError, "a ", dtype, " tensor of shape ", shape, " would need ",
           overflow ? std::string("more bytes than int64 can count") : thousands(bytes) + " bytes",
           ", more than the ", thousands(kMaxTensorBytes), " bytes any machine can address");
  return static_cast<size_t>(bytes);
}

}  // namespace

Tensor empty(const Shape& shape, TensorOptions opts) {
  const size_t bytes = contiguous_bytes(shape, opts.dtype);
  auto impl = std::make_shared<TensorImpl>();
  try {
    impl->storage = std::make_shared<Storage>(bytes, opts.device);
  } catch (const std::bad_alloc&) {  // the allocator's own bookkeeping: the same condition as its MemoryError
    throw MemoryError(str("out of memory allocating ", thousands(static_cast<int64_t>(bytes)), " bytes for a ",
                          opts.dtype, " tensor of shape ", shape, " on ", opts.device));
  }
  impl->sizes = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = opts.dtype;
  Tensor t(std::move(impl));
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor make_view(const std::shared_ptr<Storage>& storage, const Shape& sizes, const Shape& strides, int64_t offset,
                 DType dtype) {
  MN_CHECK(storage != nullptr, ValueError, "make_view: no storage to view");
  MN_CHECK(sizes.size() == strides.size(), ValueError, "make_view: sizes ", sizes, " and strides ", strides,
           " differ in length");
  bool valid = offset >= 0;
  for (int i = 0; i < sizes.size(); ++i) valid = valid && sizes[i] >= 0 && strides[i] >= 0;
  MN_CHECK(valid, ValueError, "make_view: sizes ", sizes, ", strides ", strides, " and offset ", offset,
           " must be non-negative");
  if (sizes.numel() > 0) {
    // The element furthest into the storage must lie inside it.
    const int64_t last = last_element(sizes, strides, offset);
    int64_t end = 0;
    const bool overflow = add_overflows(last, 1, &end) || mul_overflows(end, static_cast<int64_t>(dtype_size(dtype)), &end);
    MN_CHECK(!overflow && static_cast<uint64_t>(end) <= storage->nbytes(), IndexError, "make_view: a ", dtype,
             " view with sizes ", sizes, ", strides ", strides, " and offset ", offset, " reaches element ", last,
             ", beyond its storage of ", thousands(static_cast<int64_t>(storage->nbytes())), " bytes");
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage;
  impl->sizes = sizes;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor empty_like(const Tensor& t) { return empty(t.sizes(), t.options()); }

int64_t Tensor::size(int64_t dim) const { return sizes()[wrap_dim(dim, this->dim())]; }
int64_t Tensor::stride(int64_t dim) const { return strides()[wrap_dim(dim, this->dim())]; }

bool Tensor::is_contiguous() const {
  const TensorImpl* t = checked();
  if (t->sizes.numel() == 0) return true;  // no element to be out of place (as PyTorch; [37, 0] included)
  int64_t expected = 1;
  for (int i = t->sizes.size() - 1; i >= 0; --i) {
    if (t->sizes[i] == 1) continue;
    if (t->strides[i] != expected) return false;
    expected *= t->sizes[i];
  }
  return true;
}

double Tensor::item() const {
  MN_CHECK(numel() == 1, ValueError, "item() expects a tensor with one element, got shape ", sizes());
  capture::unsupported("Tensor::item() reads a value on the host");
  Tensor host = device().is_cpu() ? *this : to(kCPU);
  switch (host.dtype()) {
    case DType::f32: return *host.data<float>();
    case DType::bf16: return static_cast<float>(*host.data<BFloat16>());
    case DType::f16: return static_cast<float>(*host.data<Half>());
    case DType::i64: break;
  }
  return static_cast<double>(*host.data<int64_t>());
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  capture::unsupported("Tensor::to_vector() reads values on the host");
  Tensor host = device().is_cpu() ? *this : to(kCPU);
  if (host.dtype() != dtype_of<T>::value) host = host.to(dtype_of<T>::value);
  host = host.contiguous();
  const T* p = host.data<T>();
  return std::vector<T>(p, p + host.numel());
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;

namespace {
void print_rec(std::ostream& os, const std::vector<double>& v, const Shape& s, int d, int64_t& pos,
               bool is_float, int indent) {
  if (d == s.size()) {
    char buf[64];
    if (is_float)
      std::snprintf(buf, sizeof buf, "%.6g", v[pos]);
    else
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v[pos]));
    os << buf;
    ++pos;
    return;
  }
  os << '[';
  const int64_t n = s[d];
  const bool elide = n > 12;
  for (int64_t i = 0; i < n; ++i) {
    if (elide && i == 3) {
      os << "..., ";
      int64_t skip = 1;
      for (int k = d + 1; k < s.size(); ++k) skip *= s[k];
      pos += skip * (n - 6);
      i = n - 3;
    }
    if (d + 1 < s.size() && i > 0) os << ",\n" << std::string(indent + 1, ' ');
    else if (i > 0) os << ", ";
    print_rec(os, v, s, d + 1, pos, is_float, indent + 1);
  }
  os << ']';
}
}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "tensor(";
  std::vector<double> values;
  if (is_floating_point(dtype())) {
    for (float f : to_vector<float>()) values.push_back(f);
  } else {
    for (int64_t i : to_vector<int64_t>()) values.push_back(static_cast<double>(i));
  }
  int64_t pos = 0;
  print_rec(os, values, sizes(), 0, pos, is_floating_point(dtype()), 7);
  os << ", shape=" << sizes() << ", dtype=" << dtype();
  if (!device().is_cpu()) os << ", device=" << device();
  if (requires_grad()) os << ", requires_grad=true";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

// ---- autograd state core can read ----
namespace {
const std::shared_ptr<autograd::Node> kNoNode;
}  // namespace

bool Tensor::requires_grad() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m != nullptr && m->requires_grad;
}

bool Tensor::is_leaf() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m == nullptr || !m->grad_fn;
}

const std::shared_ptr<autograd::Node>& Tensor::grad_fn() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m ? m->grad_fn : kNoNode;
}

Tensor Tensor::grad() const {
  auto* m = checked()->autograd.load(std::memory_order_acquire);
  return m ? m->grad : Tensor();
}

Tensor Tensor::detach() const {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = storage();
  impl->sizes = sizes();
  impl->strides = strides();
  impl->offset = storage_offset();
  impl->dtype = dtype();
  return Tensor(std::move(impl));
}

// ---- methods forwarding to the autograd layer (core/tensor_hooks.h) ----
namespace {
std::atomic<const detail::TensorHooks*> g_hooks{nullptr};

const detail::TensorHooks& hooks(const char* method) {
  const detail::TensorHooks* h = g_hooks.load(std::memory_order_acquire);
  MN_CHECK(h != nullptr, RuntimeError, "Tensor::", method,
           " needs the autograd layer, whose tensor methods are not installed: include autograd/ops.h (or "
           "mapping/mapping_networks.h) in a file of the program and link mn::mapping_networks");
  return *h;
}
}  // namespace

void detail::set_tensor_hooks(const TensorHooks* h) { g_hooks.store(h, std::memory_order_release); }

Tensor& Tensor::requires_grad_(bool on) {
  hooks("requires_grad_").requires_grad_(*this, on);
  return *this;
}
void Tensor::set_grad(const Tensor& g) const { hooks("set_grad").set_grad(*this, g); }
void Tensor::backward(const Tensor& grad, bool retain_graph, bool create_graph) const {
  hooks("backward").backward(*this, grad, retain_graph, create_graph);
}
void Tensor::retain_grad() const { hooks("retain_grad").retain_grad(*this); }
void Tensor::register_post_accumulate_grad_hook(std::function<void(const Tensor&)> hook) const {
  hooks("register_post_accumulate_grad_hook").register_post_accumulate_grad_hook(*this, std::move(hook));
}

Tensor Tensor::view(const Shape& shape) const { return hooks("view").view(*this, shape); }
Tensor Tensor::reshape(const Shape& shape) const { return hooks("reshape").reshape(*this, shape); }
Tensor Tensor::permute(const std::vector<int64_t>& dims) const { return hooks("permute").permute(*this, dims); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return hooks("transpose").transpose(*this, d0, d1); }
Tensor Tensor::t() const {
  MN_CHECK(dim() == 2, ValueError, "t() expects a 2-D tensor, got shape ", sizes());
  return hooks("t").transpose(*this, 0, 1);
}
Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  return hooks("narrow").narrow(*this, d, start, length);
}
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return hooks("slice").slice(*this, d, start, end, step);
}
Tensor Tensor::select(int64_t d, int64_t index) const { return hooks("select").select(*this, d, index); }
Tensor Tensor::squeeze(int64_t d) const { return hooks("squeeze").squeeze(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return hooks("unsqueeze").unsqueeze(*this, d); }
Tensor Tensor::expand(const Shape& shape) const { return hooks("expand").expand(*this, shape); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return hooks("flatten").flatten(*this, s, e); }
Tensor Tensor::contiguous() const { return hooks("contiguous").contiguous(*this); }
Tensor Tensor::clone() const { return hooks("clone").clone(*this); }
Tensor Tensor::index_select(int64_t d, const Tensor& index) const {
  return hooks("index_select").index_select(*this, d, index);
}
Tensor Tensor::to(DType t) const { return hooks("to").to_dtype(*this, t); }
Tensor Tensor::to(Device d) const { return hooks("to").to_device(*this, d); }
Tensor& Tensor::copy_(const Tensor& src) {
  hooks("copy_").copy_(*this, src);
  return *this;
}
Tensor& Tensor::fill_(double value) {
  hooks("fill_").fill_(*this, value);
  return *this;
}

}  // namespace mn
