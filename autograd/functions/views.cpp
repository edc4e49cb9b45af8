// View and layout ops (share storage; backward maps the gradient back to the input's layout) and
// the copies around them: contiguous, clone, dtype/device conversion, cat/stack/split.
#include <numeric>

#include "autograd/functions/common.h"

namespace mn {

using autograd::GradContext;
using autograd::SavedTensor;
using autograd::TensorList;

namespace {

// Infers one -1 entry and checks the element count.
Shape infer_shape(const Shape& shape, int64_t numel, const Shape& from) {
  Shape out = shape;
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      MN_CHECK(infer < 0, ValueError, "only one dimension can be inferred (-1) in shape ", shape);
      infer = i;
    } else {
      MN_CHECK(out[i] >= 0, ValueError, "invalid shape ", shape, ": negative dimension ", out[i]);
      known *= out[i];
    }
  }
  if (infer >= 0) {
    MN_CHECK(known != 0 && numel % known == 0, ValueError, "shape ", shape, " is invalid for input of shape ", from,
             " (", numel, " elements)");
    out[infer] = numel / known;
  }
  MN_CHECK(out.numel() == numel, ValueError, "shape ", shape, " is invalid for input of shape ", from, " (", numel,
           " elements)");
  return out;
}

// Strides for viewing (sizes, strides) as new_sizes without copying, if possible.
bool view_strides(const Shape& sizes, const Shape& strides, const Shape& new_sizes, Shape& out) {
  out = Shape::filled(new_sizes.size(), 1);
  bool contiguous = true;
  int64_t expected = 1;
  for (int d = sizes.size() - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) contiguous = false;
    expected *= sizes[d];
  }
  if (sizes.numel() == 0 || contiguous) {
    out = contiguous_strides(new_sizes);
    return true;
  }
  // Walk chunks of old dims that are contiguous among themselves and match them to new dims.
  int view_d = new_sizes.size() - 1;
  int64_t chunk_base_stride = strides.size() ? strides.back() : 1;
  int64_t tensor_numel = 1, view_numel = 1;
  for (int d = sizes.size() - 1; d >= 0; --d) {
    tensor_numel *= sizes[d];
    if (d == 0 || (sizes[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
        out[view_d] = view_numel * chunk_base_stride;
        view_numel *= new_sizes[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

Tensor make_alias(const Tensor& x, const Shape& sizes, const Shape& strides, int64_t offset) {
  return detail::raw_view(x, sizes, strides, offset);
}

// Records a view op whose backward is `back(grad)`.
template <class F>
Tensor record_view(const char* name, const Tensor& x, Tensor out, F&& back) {
  if (autograd::needs_grad({&x}))
    autograd::record(name, {&x}, {&out}, [back = std::forward<F>(back)](const GradContext& c) -> TensorList {
      return {back(c.grad())};
    });
  return out;
}

}  // namespace

Tensor view(const Tensor& x, const Shape& shape) {
  const Shape sizes = infer_shape(shape, x.numel(), x.sizes());
  Shape strides;
  MN_CHECK(view_strides(x.sizes(), x.strides(), sizes, strides), ValueError, "view of shape ", x.sizes(), " as ",
           sizes, " is not possible with its strides ", x.strides(), "; use reshape() (which copies)");
  Tensor out = make_alias(x, sizes, strides, x.storage_offset());
  return record_view("ViewBackward", x, out, [in = x.sizes()](const Tensor& g) { return reshape(g, in); });
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  const Shape sizes = infer_shape(shape, x.numel(), x.sizes());
  Shape strides;
  if (view_strides(x.sizes(), x.strides(), sizes, strides)) return view(x, sizes);
  return view(contiguous(x), sizes);
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) {
  const int n = x.dim();
  MN_CHECK(static_cast<int>(dims.size()) == n, ValueError, "permute: expected ", n, " dims for shape ", x.sizes(),
           ", got ", dims.size());
  Shape sizes = Shape::filled(n, 0), strides = Shape::filled(n, 0);
  std::vector<int64_t> inverse(n, -1);
  for (int i = 0; i < n; ++i) {
    const int d = wrap_dim(dims[i], n);
    MN_CHECK(inverse[d] < 0, ValueError, "permute: dimension ", dims[i], " repeated");
    inverse[d] = i;
    sizes[i] = x.sizes()[d];
    strides[i] = x.strides()[d];
  }
  Tensor out = make_alias(x, sizes, strides, x.storage_offset());
  return record_view("PermuteBackward", x, out, [inverse](const Tensor& g) { return permute(g, inverse); });
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  const int n = x.dim();
  const int a = wrap_dim(d0, n), b = wrap_dim(d1, n);
  std::vector<int64_t> dims(n);
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[a], dims[b]);
  return permute(x, dims);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  const int d = wrap_dim(dim, x.dim());
  MN_CHECK(step > 0, ValueError, "slice: step must be positive, got ", step);
  const int64_t size = x.sizes()[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<int64_t>(start, 0, size);
  end = std::clamp<int64_t>(end, start, size);
  Shape sizes = x.sizes(), strides = x.strides();
  sizes[d] = (end - start + step - 1) / step;
  strides[d] *= step;
  Tensor out = make_alias(x, sizes, strides, x.storage_offset() + start * x.strides()[d]);
  return record_view("SliceBackward", x, out, [in = x.sizes(), d, start, end, step](const Tensor& g) {
    const TensorOptions options = g.options();
    // Scatter g into the sliced positions with a differentiable path: zeros around g, joined by cat,
    // when step == 1 (one pass over the input's size).
    if (step == 1) {
      auto zero_part = [&](int64_t length) {
        Shape part = in;
        part[d] = length;
        return zeros(part, options);
      };
      std::vector<Tensor> parts;
      if (start > 0) parts.push_back(zero_part(start));
      parts.push_back(g);
      if (end < in[d]) parts.push_back(zero_part(in[d] - end));
      return parts.size() == 1 ? g : cat(parts, d);
    }
    Tensor full_grad = zeros(in, options);
    Tensor idx = arange(static_cast<double>(start), static_cast<double>(end), static_cast<double>(step),
                        TensorOptions(DType::i64).with_device(g.device()));
    Tensor target = detail::raw_contiguous(full_grad);
    kernels::index_add(g.device(), target, d, idx, detail::raw_contiguous(g));
    return target;
  });
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  const int d = wrap_dim(dim, x.dim());
  const int64_t size = x.sizes()[d];
  if (start < 0) start += size;
  MN_CHECK(start >= 0 && length >= 0 && start + length <= size, IndexError, "narrow: range [", start, ", ",
           start + length, ") is out of bounds for dimension ", dim, " of size ", size, " (shape ", x.sizes(), ")");
  return slice(x, d, start, start + length, 1);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  const int d = wrap_dim(dim, x.dim());
  const int64_t size = x.sizes()[d];
  MN_CHECK(index >= -size && index < size, IndexError, "select: index ", index, " is out of bounds for dimension ",
           dim, " of size ", size, " (shape ", x.sizes(), ")");
  if (index < 0) index += size;
  return squeeze(narrow(x, d, index, 1), d);
}

Tensor squeeze(const Tensor& x, int64_t dim) {
  const int d = wrap_dim(dim, x.dim());
  if (x.sizes()[d] != 1) return x;
  Shape sizes = x.sizes(), strides = x.strides();
  sizes.erase(d);
  strides.erase(d);
  Tensor out = make_alias(x, sizes, strides, x.storage_offset());
  return record_view("SqueezeBackward", x, out, [d](const Tensor& g) { return unsqueeze(g, d); });
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  const int d = wrap_dim(dim, x.dim() + 1);
  Shape sizes = x.sizes(), strides = x.strides();
  const int64_t stride = d < x.dim() ? x.strides()[d] * x.sizes()[d] : 1;
  sizes.insert(d, 1);
  strides.insert(d, stride);
  Tensor out = make_alias(x, sizes, strides, x.storage_offset());
  return record_view("UnsqueezeBackward", x, out, [d](const Tensor& g) { return squeeze(g, d); });
}

Tensor expand(const Tensor& x, const Shape& shape) {
  Shape target = shape;
  const int offset = shape.size() - x.dim();
  MN_CHECK(offset >= 0, ValueError, "expand: cannot expand shape ", x.sizes(), " to fewer dimensions ", shape);
  for (int i = 0; i < target.size(); ++i)
    if (target[i] == -1) {
      MN_CHECK(i >= offset, ValueError, "expand: -1 is not allowed for new leading dimension ", i);
      target[i] = x.sizes()[i - offset];
    }
  Tensor out = detail::expand_view(x, target);
  if (out.same(x)) return x;
  return record_view("ExpandBackward", x, out, [in = x.sizes()](const Tensor& g) { return sum_to(g, in); });
}

Tensor flatten(const Tensor& x, int64_t start_dim, int64_t end_dim) {
  if (x.dim() == 0) return reshape(x, {1});
  const int s = wrap_dim(start_dim, x.dim()), e = wrap_dim(end_dim, x.dim());
  MN_CHECK(s <= e, ValueError, "flatten: start_dim ", start_dim, " comes after end_dim ", end_dim);
  Shape sizes;
  for (int i = 0; i < s; ++i) sizes.push_back(x.sizes()[i]);
  int64_t merged = 1;
  for (int i = s; i <= e; ++i) merged *= x.sizes()[i];
  sizes.push_back(merged);
  for (int i = e + 1; i < x.dim(); ++i) sizes.push_back(x.sizes()[i]);
  return reshape(x, sizes);
}

// ---- copies ----

Tensor clone(const Tensor& x) {
  Tensor out = empty(x.sizes(), x.options());
  kernels::copy(x.device(), x, out);
  return record_view("CloneBackward", x, out, [](const Tensor& g) { return g; });
}

Tensor contiguous(const Tensor& x) { return x.is_contiguous() ? x : clone(x); }

Tensor to_dtype(const Tensor& x, DType dtype) {
  if (x.dtype() == dtype) return x;
  Tensor out = empty(x.sizes(), TensorOptions(dtype).with_device(x.device()));
  kernels::copy(x.device(), x, out);
  // Between floating dtypes the gradient converts back (rounding when x is 16-bit); to or from i64
  // no gradient flows.
  if (!is_floating_point(x.dtype()) || !is_floating_point(dtype)) return out;
  return record_view("ToCopyBackward", x, out, [from = x.dtype()](const Tensor& g) { return to_dtype(g, from); });
}

Tensor to_device(const Tensor& x, Device device) {
  if (x.device() == device) return x;
  MN_CHECK(device.is_cpu() || cuda_available(), DeviceError, "cannot move a tensor to ", device,
           ": no CUDA device is available (cuda_device_count() == 0)");
  Tensor out = empty(x.sizes(), TensorOptions(x.dtype()).with_device(device));
  // Cross-device copies are served by the device side's copy kernel (CUDA handles host<->device).
  Tensor src = detail::raw_contiguous(x);
  kernels::copy(device.is_cpu() ? src.device() : device, src, out);
  return record_view("ToDeviceBackward", x, out, [from = x.device()](const Tensor& g) { return to_device(g, from); });
}

// ---- cat / stack / split ----

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  MN_CHECK(!tensors.empty(), ValueError, "cat: expected a non-empty list of tensors");
  const Tensor& first = tensors[0];
  const int d = wrap_dim(dim, first.dim());
  Shape out_shape = first.sizes();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    detail::check_same_device("cat", first, t);
    detail::check_same_dtype("cat", first, t);
    MN_CHECK(t.dim() == first.dim(), ValueError, "cat: tensor ", i, " has shape ", t.sizes(),
             " but tensor 0 has shape ", first.sizes(), " (same number of dimensions expected)");
    for (int k = 0; k < t.dim(); ++k)
      MN_CHECK(k == d || t.sizes()[k] == first.sizes()[k], ValueError, "cat: tensor ", i, " has shape ", t.sizes(),
               " but tensor 0 has shape ", first.sizes(), " (sizes must match except in dimension ", d, ")");
    total += t.sizes()[d];
  }
  out_shape[d] = total;
  Tensor out = empty(out_shape, first.options());
  std::vector<int64_t> sizes;
  int64_t pos = 0;
  for (const Tensor& t : tensors) {
    Shape strides = out.strides();
    Shape part_sizes = out_shape;
    part_sizes[d] = t.sizes()[d];
    Tensor part = detail::raw_view(out, part_sizes, strides, pos * out.strides()[d]);
    kernels::copy(t.device(), t, part);
    sizes.push_back(t.sizes()[d]);
    pos += t.sizes()[d];
  }
  if (autograd::needs_grad(tensors))
    autograd::record_list("CatBackward", tensors, {&out}, [sizes, d](const GradContext& c) -> TensorList {
      TensorList grads;
      int64_t p = 0;
      for (int64_t s : sizes) {
        grads.push_back(narrow(c.grad(), d, p, s));
        p += s;
      }
      return grads;
    });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  MN_CHECK(!tensors.empty(), ValueError, "stack: expected a non-empty list of tensors");
  const int d = wrap_dim(dim, tensors[0].dim() + 1);
  std::vector<Tensor> parts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    MN_CHECK(tensors[i].sizes() == tensors[0].sizes(), ValueError, "stack: tensor ", i, " has shape ",
             tensors[i].sizes(), " but tensor 0 has shape ", tensors[0].sizes());
    parts.push_back(unsqueeze(tensors[i], d));
  }
  return cat(parts, d);
}

std::vector<Tensor> split_with_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  const int d = wrap_dim(dim, x.dim());
  int64_t total = 0;
  for (int64_t s : sizes) {
    MN_CHECK(s >= 0, ValueError, "split_with_sizes: sizes must be non-negative, got ", s);
    total += s;
  }
  MN_CHECK(total == x.sizes()[d], ValueError, "split_with_sizes: sizes add up to ", total, " but dimension ", dim,
           " of shape ", x.sizes(), " has ", x.sizes()[d]);
  std::vector<Tensor> parts;
  parts.reserve(sizes.size());
  int64_t pos = 0;
  for (int64_t s : sizes) {
    Shape part = x.sizes();
    part[d] = s;
    parts.push_back(make_alias(x, part, x.strides(), x.storage_offset() + pos * x.strides()[d]));
    pos += s;
  }
  // One node for all the parts: its backward joins their gradients (zeros for parts that got none)
  // with one cat, where separate slices would each build an input-sized gradient to be summed.
  if (autograd::needs_grad({&x})) {
    std::vector<Tensor*> outputs;
    for (Tensor& p : parts) outputs.push_back(&p);
    autograd::record_list("SplitBackward", {x}, std::move(outputs),
                          [in = x.sizes(), d, sizes](const GradContext& c) -> TensorList {
                            std::vector<Tensor> grads;
                            grads.reserve(sizes.size());
                            const Tensor* any = nullptr;
                            for (size_t i = 0; i < sizes.size(); ++i)
                              if (c.grad(i).defined()) any = &c.grad(i);
                            for (size_t i = 0; i < sizes.size(); ++i) {
                              if (c.grad(i).defined()) {
                                grads.push_back(c.grad(i));
                                continue;
                              }
                              Shape part = in;
                              part[d] = sizes[i];
                              grads.push_back(zeros(part, TensorOptions(any->dtype()).with_device(any->device())));
                            }
                            return {grads.size() == 1 ? grads[0] : cat(grads, d)};
                          });
  }
  return parts;
}

std::vector<Tensor> split(const Tensor& x, int64_t split_size, int64_t dim) {
  const int d = wrap_dim(dim, x.dim());
  MN_CHECK(split_size > 0, ValueError, "split: split_size must be positive, got ", split_size);
  std::vector<int64_t> sizes;
  for (int64_t s = 0; s < x.sizes()[d]; s += split_size) sizes.push_back(std::min(split_size, x.sizes()[d] - s));
  return split_with_sizes(x, sizes, d);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  MN_CHECK(chunks > 0, ValueError, "chunk: number of chunks must be positive, got ", chunks);
  const int64_t size = x.size(dim);
  return split(x, std::max<int64_t>(1, (size + chunks - 1) / chunks), dim);
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  const int d = wrap_dim(dim, x.dim());
  MN_CHECK(index.dtype() == DType::i64 && index.dim() <= 1, TypeError,
           "index_select: expected a 1-D i64 index, got ", index.dtype(), index.sizes());
  detail::check_same_device("index_select", x, index);
  Tensor idx = index.dim() == 0 ? index.reshape({1}) : index;
  Shape shape = x.sizes();
  shape[d] = idx.numel();
  Tensor out = empty(shape, x.options());
  kernels::index_select(x.device(), x, d, idx, out);
  if (autograd::needs_grad({&x}))
    autograd::record("IndexSelectBackward", {&x}, {&out},
                     [in = x.sizes(), d, si = SavedTensor::input(idx)](const GradContext& c) -> TensorList {
                       Tensor g = zeros(in, c.grad().options());
                       kernels::index_add(g.device(), g, d, si.unpack(), detail::raw_contiguous(c.grad()));
                       return {g};
                     });
  return out;
}

// ---- in-place ----

namespace {

bool same_view(const Tensor& a, const Tensor& b) {
  return a.storage() == b.storage() && a.storage_offset() == b.storage_offset() && a.sizes() == b.sizes() &&
         a.strides() == b.strides() && a.dtype() == b.dtype();
}

// [first, last] addresses of the bytes a tensor with elements reaches (strides are non-negative: make_view).
std::pair<uintptr_t, uintptr_t> byte_extent(const Tensor& t) {
  const auto item = static_cast<uintptr_t>(dtype_size(t.dtype()));
  const auto base = reinterpret_cast<uintptr_t>(t.storage()->data());
  const auto last = static_cast<uintptr_t>(last_element(t.sizes(), t.strides(), t.storage_offset()));
  return {base + static_cast<uintptr_t>(t.storage_offset()) * item, base + (last + 1) * item - 1};
}

// As PyTorch: a write through a tensor whose elements alias each other, or from a source that partly
// aliases the destination, has no well-defined result (it depends on the kernel's order).
void check_copy_overlap(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  for (int d = 0; d < dst.dim(); ++d)
    MN_CHECK(dst.sizes()[d] == 1 || dst.strides()[d] != 0, RuntimeError,
             "copy_: unsupported operation: more than one element of the written-to tensor (shape ", dst.sizes(),
             ", strides ", dst.strides(), ") refers to a single memory location; clone() it first");
  if (src.numel() == 0 || src.device() != dst.device() || same_view(dst, src)) return;
  const auto [d0, d1] = byte_extent(dst);
  const auto [s0, s1] = byte_extent(src);
  MN_CHECK(d1 < s0 || s1 < d0, RuntimeError,
           "copy_: unsupported operation: some elements of the input tensor (shape ", src.sizes(), ", strides ",
           src.strides(), ", offset ", src.storage_offset(), ") and the written-to tensor (shape ", dst.sizes(),
           ", strides ", dst.strides(), ", offset ", dst.storage_offset(),
           ") refer to a single memory location; clone() the source first");
}

}  // namespace

// Recorded like PyTorch's CopyBackwards when either side needs a gradient: the destination's new value
// is the (broadcast) source, so the source gets the gradient summed back to its shape and the
// overwritten old value gets zero. An integer destination carries no gradient (a plain copy).
void detail::copy_into(Tensor& self, const Tensor& src) {
  MN_CHECK(src.defined(), ValueError, "copy_: the source tensor is undefined");
  check_copy_overlap(self, src);
  const bool record =
      autograd::grad_mode_enabled() && self.dtype() == DType::f32 && (self.requires_grad() || src.requires_grad());
  if (record) {
    MN_CHECK(!(self.is_leaf() && self.requires_grad()), RuntimeError,
             "copy_: a leaf tensor that requires grad cannot be written in place while recording; use NoGradGuard "
             "(as for initialisation) or an out-of-place op");
    // The history goes on this tensor alone: another view or base of the same memory would read the new
    // values without it, and its gradient would silently miss the source.
    MN_CHECK(self.storage().use_count() == 1, RuntimeError, "copy_: cannot record a copy ",
             src.requires_grad() ? "from a tensor that requires grad " : "", "into a tensor (shape ", self.sizes(),
             ") whose memory other tensors share (a view, its base or a detached alias): they would not see the "
             "copy's history; copy into a fresh tensor, or build the result out of place (cat, stack, where)");
  }
  // Across devices (as in to_device) the copy is the device side's kernel, which handles host <-> device
  // in both directions and device <-> device.
  const Device here = self.device(), there = src.device();
  kernels::copy(here.is_cpu() ? there : here, detail::expand_view(src, self.sizes()), self);
  self.bump_version();
  if (record)
    autograd::record("CopyBackward", {&self, &src}, {&self},
                     [src_shape = src.sizes(), src_device = src.device()](const GradContext& c) -> TensorList {
                       const Tensor& g = c.grad();
                       if (!g.defined()) return {Tensor(), Tensor()};
                       Tensor to_src;
                       if (c.needs(1)) {
                         to_src = sum_to(g, src_shape);
                         if (to_src.device() != src_device) to_src = to_device(to_src, src_device);
                       }
                       return {c.needs(0) ? zeros_like(g) : Tensor(), to_src};
                     });
}

void detail::fill_with(Tensor& self, double value) {
  MN_CHECK(!(self.requires_grad() && autograd::grad_mode_enabled()), RuntimeError,
           "fill_ on a tensor that requires grad is not supported while recording; use NoGradGuard");
  kernels::fill(self.device(), self, value);
  self.bump_version();
}

}  // namespace mn
