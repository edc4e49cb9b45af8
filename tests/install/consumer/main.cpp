// Smallest use of the installed library: two tensors, a product, a reduction and backward.
#include <cstdio>
#include <vector>

#include "mapping/mapping_networks.h"

int main() {
  try {
    mn::Tensor a = mn::from_vector(std::vector<float>{1, 2, 3});
    a.requires_grad_();
    mn::Tensor b = mn::from_vector(std::vector<float>{4, 5, 6});
    mn::Tensor y = mn::sum(a * b);
    y.backward();
    std::vector<float> grad = a.grad().to_vector<float>();
    std::printf("mn_consumer: y=%g grad_a=%g,%g,%g\n", y.item(), grad.at(0), grad.at(1), grad.at(2));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mn_consumer: %s\n", e.what());
    return 1;
  }
}
