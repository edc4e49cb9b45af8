// The CUDA kernels' index divider (kernels/cuda/divider.h) is plain C++ on the host, with the same
// arithmetic as on the device (a 32-bit multiply-high there, a 64-bit product here), so its quotients
// and remainders are checked here against `/` and `%`, with or without a GPU: every divisor up to
// 1,024 against every dividend below 20,000, divisors at and around each power of two up to 2^31 - 1
// at and around their multiples, random pairs over the whole 31-bit range, and the 64-bit fallback.
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cuda/divider.h"
#include "tests/test_support.h"

using mn::cuda::Divider;

namespace {

constexpr int64_t kLimit = Divider::kNarrowLimit;  // 2^31 - 1

// Counts dividends whose quotient or remainder differs from the operators' (0 expected); checks
// each at most once per call so a failure reports a count instead of millions of lines.
int64_t mismatches(const Divider& div, const std::vector<int64_t>& dividends) {
  int64_t bad = 0;
  for (const int64_t n : dividends) {
    int64_t q = -1, r = -1;
    div.divmod(n, &q, &r);
    if (q != n / div.divisor() || r != n % div.divisor() || div.div(n) != q || div.mod(n) != r) ++bad;
  }
  return bad;
}

// Dividends below `bound` around multiples of d: q * d - 1, q * d, q * d + 1 for q spread over the range.
std::vector<int64_t> around_multiples(int64_t d, int64_t bound, std::mt19937_64& rng) {
  std::vector<int64_t> out = {0, 1, d - 1, d, d + 1, bound - 1, bound - 2};
  const int64_t q_max = (bound - 1) / d;
  for (int64_t q : {int64_t{1}, int64_t{2}, q_max - 1, q_max}) {
    for (int64_t delta : {-1, 0, 1}) out.push_back(q * d + delta);
  }
  std::uniform_int_distribution<int64_t> pick(0, q_max);
  for (int k = 0; k < 64; ++k) {
    const int64_t q = pick(rng);
    for (int64_t delta : {-1, 0, 1}) out.push_back(q * d + delta);
  }
  std::vector<int64_t> valid;
  for (int64_t n : out)
    if (n >= 0 && n < bound) valid.push_back(n);
  return valid;
}

}  // namespace

TEST_CASE("cuda divider: every divisor up to 1,024 against every dividend below 20,000") {
  std::vector<int64_t> dividends(20000);
  for (int64_t n = 0; n < 20000; ++n) dividends[n] = n;
  int64_t bad = 0;
  for (int64_t d = 1; d <= 1024; ++d) {
    const Divider div(d, 20000);
    REQUIRE(div.narrow());
    bad += mismatches(div, dividends);
  }
  CHECK(bad == 0);
}

TEST_CASE("cuda divider: divisors around powers of two, dividends around their multiples, up to 2^31 - 1") {
  std::mt19937_64 rng(20261129);
  std::vector<int64_t> divisors = {kLimit, kLimit - 1, 3, 5, 7, 11, 13, 26, 676, 1000003, 2147483629};
  for (int k = 1; k <= 31; ++k) {
    for (int64_t delta : {-1, 0, 1}) {
      const int64_t d = (int64_t{1} << k) + delta;
      if (d >= 1 && d <= kLimit) divisors.push_back(d);
    }
  }
  int64_t bad = 0;
  for (const int64_t d : divisors) {
    const Divider div(d, kLimit);
    REQUIRE(div.narrow());
    bad += mismatches(div, around_multiples(d, kLimit, rng));
  }
  CHECK(bad == 0);
}

TEST_CASE("cuda divider: random divisors and dividends over the 31-bit range") {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> any(0, kLimit - 1);
  std::uniform_int_distribution<int> bits(1, 31);
  int64_t bad = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    // Divisors of every magnitude, not only large ones (a uniform pick would almost never be small).
    const int64_t d = 1 + any(rng) % (int64_t{1} << bits(rng));
    std::vector<int64_t> dividends(256);
    for (int64_t& n : dividends) n = any(rng);
    bad += mismatches(Divider(d, kLimit), dividends);
  }
  CHECK(bad == 0);
}

TEST_CASE("cuda divider: 64-bit dividends or divisors take the exact fallback") {
  const int64_t big = int64_t{1} << 40;
  const Divider wide_dividends(12345, big);
  CHECK_FALSE(wide_dividends.narrow());
  CHECK(mismatches(wide_dividends, {0, 12344, 12345, big - 1, (int64_t{1} << 31) + 7}) == 0);
  const Divider wide_divisor(kLimit + 2, big);
  CHECK_FALSE(wide_divisor.narrow());
  CHECK(mismatches(wide_divisor, {0, kLimit + 1, kLimit + 2, big - 1}) == 0);
  // The first bound past the 32-bit path: divisor and dividends fitting 31 bits stay narrow.
  CHECK(Divider(kLimit, kLimit).narrow());
  CHECK_FALSE(Divider(7, kLimit + 1).narrow());
}

TEST_CASE("cuda divider: the default and the divisors of empty shapes divide by one") {
  const Divider one;
  CHECK(one.divisor() == 1);
  CHECK(mismatches(one, {0, 1, 2, kLimit - 1}) == 0);
  for (int64_t empty : {int64_t{0}, int64_t{-3}}) {
    const Divider d(empty, 10);
    CHECK(d.divisor() == 1);
    CHECK(d.div(9) == 9);
  }
}
