// mn::get_num_threads / set_num_threads: the calling thread's OpenMP thread count, a clear error for
// a count below one, results that do not depend on it, and other threads keeping their own setting.
#include <thread>

#include "core/parallel.h"
#include "tests/test_support.h"

using namespace mn;

TEST_CASE("parallel: set_num_threads sets the calling thread's count and refuses counts below one") {
  const int before = get_num_threads();
  REQUIRE(before >= 1);
  const Tensor a = testing::random_tensor({300, 257}, 5), b = testing::random_tensor({300, 257}, 6);
  const std::vector<float> many = add(mul(a, b), a).to_vector<float>();

  const int changed = before == 1 ? 2 : 1;  // differs from the default whatever OMP_NUM_THREADS says
  set_num_threads(changed);
  CHECK(get_num_threads() == changed);
  // Elementwise results are the same whatever the thread count.
  CHECK(add(mul(a, b), a).to_vector<float>() == many);
  // A thread started now keeps the process default (OpenMP's setting is per thread).
  int other = 0;
  std::thread([&] { other = get_num_threads(); }).join();
  CHECK(other == before);

  set_num_threads(before);
  CHECK(get_num_threads() == before);

  for (int bad : {0, -2}) {
    CHECK_THROWS_AS(set_num_threads(bad), ValueError);
    const std::string expected = "expected a thread count >= 1, got " + std::to_string(bad);
    CHECK_THROWS_WITH(set_num_threads(bad), doctest::Contains(expected.c_str()));
  }
  CHECK(get_num_threads() == before);
}
