#pragma once
// For CUDA kernels registered as taking 16-bit tensors (kernels/dispatch.h) that meet a case they do
// not run natively (mixed dtypes, an empty sum): the dispatcher's own treatment, called directly.
// Each bf16/f16 argument becomes an f32 copy (lowp::hold), the kernel runs on those, and the written
// ones (the signature's Tensor& parameters) are rounded back.
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/dispatch.h"

namespace mn::kernels::lowp {

template <class Fn, size_t... I, class... A>
void call_widened_impl(Fn* kernel, std::index_sequence<I...>, A&&... args) {
  using P = typename Params<Fn>::type;
  std::vector<std::pair<Tensor, Tensor>> written;
  std::tuple<Held<A>...> held(hold<std::tuple_element_t<I, P>>(std::forward<A>(args), written)...);
  std::apply([kernel](auto&... a) { kernel(a...); }, held);
  for (auto& [target, wide] : written) narrow_into(wide, target);
}

template <class Fn, class... A>
void call_widened(Fn* kernel, A&&... args) {
  call_widened_impl(kernel, std::index_sequence_for<A...>{}, std::forward<A>(args)...);
}

}  // namespace mn::kernels::lowp
