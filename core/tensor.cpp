// Tensor metadata, element access and printing. Methods that create views or copies forward to the
// differentiable ops (autograd/ops.h); factories live in kernels/factories.cpp.
#include "core/tensor.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "autograd/ops.h"
#include "core/capture.h"

namespace mn {

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
  if (host.dtype() == DType::f32) return *host.data<float>();
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
  if (dtype() == DType::f32) {
    for (float f : to_vector<float>()) values.push_back(f);
  } else {
    for (int64_t i : to_vector<int64_t>()) values.push_back(static_cast<double>(i));
  }
  int64_t pos = 0;
  print_rec(os, values, sizes(), 0, pos, dtype() == DType::f32, 7);
  os << ", shape=" << sizes() << ", dtype=" << dtype();
  if (!device().is_cpu()) os << ", device=" << device();
  if (requires_grad()) os << ", requires_grad=true";
  os << ')';
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

// ---- methods forwarding to the differentiable ops ----
Tensor Tensor::view(const Shape& shape) const { return mn::view(*this, shape); }
Tensor Tensor::reshape(const Shape& shape) const { return mn::reshape(*this, shape); }
Tensor Tensor::permute(const std::vector<int64_t>& dims) const { return mn::permute(*this, dims); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return mn::transpose(*this, d0, d1); }
Tensor Tensor::t() const {
  MN_CHECK(dim() == 2, ValueError, "t() expects a 2-D tensor, got shape ", sizes());
  return mn::transpose(*this, 0, 1);
}
Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const { return mn::narrow(*this, d, start, length); }
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return mn::slice(*this, d, start, end, step);
}
Tensor Tensor::select(int64_t d, int64_t index) const { return mn::select(*this, d, index); }
Tensor Tensor::squeeze(int64_t d) const { return mn::squeeze(*this, d); }
Tensor Tensor::unsqueeze(int64_t d) const { return mn::unsqueeze(*this, d); }
Tensor Tensor::expand(const Shape& shape) const { return mn::expand(*this, shape); }
Tensor Tensor::flatten(int64_t s, int64_t e) const { return mn::flatten(*this, s, e); }
Tensor Tensor::contiguous() const { return mn::contiguous(*this); }
Tensor Tensor::clone() const { return mn::clone(*this); }
Tensor Tensor::index_select(int64_t d, const Tensor& index) const { return mn::index_select(*this, d, index); }
Tensor Tensor::to(DType t) const { return mn::to_dtype(*this, t); }
Tensor Tensor::to(Device d) const { return mn::to_device(*this, d); }

}  // namespace mn
