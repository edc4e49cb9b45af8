#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "core/error.h"
#include "core/philox.h"
#include "core/random.h"

using mn::Distribution;
using mn::PhiloxState;

namespace {

constexpr int64_t kSamples = 1'000'000;

std::vector<float> fill_floats(int64_t n, Distribution dist, double p1, double p2, const PhiloxState& st) {
  std::vector<float> out(static_cast<size_t>(n));
  mn::philox_fill(out.data(), n, dist, p1, p2, st);
  return out;
}

std::vector<int64_t> fill_ints(int64_t n, Distribution dist, double p1, double p2, const PhiloxState& st) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  mn::philox_fill(out.data(), n, dist, p1, p2, st);
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Moments {
  double mean;
  double var;
};

template <class T>
Moments moments(const std::vector<T>& v) {
  double sum = 0.0;
  for (const T x : v) sum += static_cast<double>(x);
  const double mean = sum / static_cast<double>(v.size());
  double sq = 0.0;
  for (const T x : v) sq += (static_cast<double>(x) - mean) * (static_cast<double>(x) - mean);
  return {mean, sq / static_cast<double>(v.size())};
}

void check_kat(const uint32_t (&counter)[4], const uint32_t (&key)[2], const uint32_t (&expected)[4]) {
  const mn::Philox4 r = mn::philox4x32_10(counter, key);
  for (int lane = 0; lane < 4; ++lane) {
    CAPTURE(lane);
    CHECK(r.x[lane] == expected[lane]);
  }
}

// The int64 fill of a 0/1 or +-1 distribution holds exactly the float fill's values.
bool same_value(int64_t as_int, float as_float) { return as_int == static_cast<int64_t>(as_float); }

// Restores the OpenMP thread count when a test changes it.
struct ThreadCountGuard {
  int saved = omp_get_max_threads();
  ~ThreadCountGuard() { omp_set_num_threads(saved); }
};

}  // namespace

TEST_CASE("random: philox4x32-10 known-answer vectors") {
  check_kat({0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  check_kat({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
            {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  check_kat({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
            {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
}

TEST_CASE("random: counter layout maps block, stream and seed to counter and key words") {
  const uint64_t seed = 0x0123456789abcdefull;
  const uint64_t stream = 0xfedcba9876543210ull;
  const uint64_t block = 0x1122334455667788ull;
  const uint32_t counter[4] = {0x55667788u, 0x11223344u, 0x76543210u, 0xfedcba98u};
  const uint32_t key[2] = {0x89abcdefu, 0x01234567u};
  const mn::Philox4 direct = mn::philox4x32_10(counter, key);
  const mn::Philox4 via_block = mn::philox_block(seed, stream, block);
  for (int lane = 0; lane < 4; ++lane) CHECK(direct.x[lane] == via_block.x[lane]);
}

TEST_CASE("random: value transforms") {
  CHECK(mn::philox_uniform01(0u) == 0.0f);
  CHECK(mn::philox_uniform01(0xffffffffu) == 1.0f - std::ldexp(1.0f, -24));
  CHECK(mn::philox_uniform01(0x80000000u) == 0.5f);
  CHECK(mn::philox_uniform01_open_low(0u) == std::ldexp(1.0f, -24));
  CHECK(mn::philox_uniform01_open_low(0xffffffffu) == 1.0f);
  CHECK(mn::philox_rademacher(0x80000000u) == 1.0f);
  CHECK(mn::philox_rademacher(0x7fffffffu) == -1.0f);
  CHECK(mn::philox_bernoulli(0xffffffffu, 1.0));
  CHECK_FALSE(mn::philox_bernoulli(0u, 0.0));

  // Box-Muller: u1 = 1 gives radius 0; the smallest u1 gives the largest radius, still finite.
  float z_cos = 1.0f, z_sin = 1.0f;
  mn::philox_box_muller(0xffffffffu, 0x12345678u, z_cos, z_sin);
  CHECK(z_cos == 0.0f);
  CHECK(z_sin == 0.0f);
  mn::philox_box_muller(0u, 0u, z_cos, z_sin);
  CHECK(std::isfinite(z_cos));
  CHECK(z_cos == doctest::Approx(std::sqrt(48.0 * std::log(2.0))).epsilon(1e-5));
  CHECK(z_sin == 0.0f);
}

TEST_CASE("random: normal pairs lanes (0,1) and (2,3) with cos on the even lane") {
  const PhiloxState st{42, 7, 3};
  const mn::Philox4 r = mn::philox_block(st.seed, st.stream, st.offset);
  const auto values = fill_floats(4, Distribution::Normal, 0.0, 1.0, st);
  for (int pair = 0; pair < 2; ++pair) {
    const float u1 = mn::philox_uniform01_open_low(r.x[2 * pair]);
    const float u2 = mn::philox_uniform01(r.x[2 * pair + 1]);
    const float radius = std::sqrt(-2.0f * std::log(u1));
    const float angle = 6.28318530717958647692f * u2;
    CHECK(values[2 * pair] == doctest::Approx(radius * std::cos(angle)).epsilon(1e-6));
    CHECK(values[2 * pair + 1] == doctest::Approx(radius * std::sin(angle)).epsilon(1e-6));
  }
}

TEST_CASE("random: element i uses block offset + i/4 and lane i%4") {
  const PhiloxState st{1234, 99, 1000};
  const auto values = fill_floats(37, Distribution::Uniform, 0.0, 1.0, st);
  for (int64_t i = 0; i < 37; ++i) {
    CAPTURE(i);
    const mn::Philox4 r = mn::philox_block(st.seed, st.stream, st.offset + static_cast<uint64_t>(i / 4));
    CHECK(values[static_cast<size_t>(i)] == mn::philox_uniform01(r.x[i % 4]));
    CHECK(values[static_cast<size_t>(i)] == mn::philox_float_at(st, i, Distribution::Uniform, 0.0, 1.0));
  }
  const auto ints = fill_ints(37, Distribution::Uniform, -5.0, 17.0, st);
  for (int64_t i = 0; i < 37; ++i) {
    CHECK(ints[static_cast<size_t>(i)] == mn::philox_int64_at(st, i, Distribution::Uniform, -5.0, 17.0));
  }
}

TEST_CASE("random: same state gives the same values, run to run and for any thread count") {
  ThreadCountGuard guard;
  const PhiloxState st{0xdeadbeef, mn::stream_key("layer.0"), 12345};
  // Large enough that the parallel path is taken.
  const int64_t n = 100'003;
  for (const Distribution dist : {Distribution::Uniform, Distribution::Normal, Distribution::Rademacher,
                                  Distribution::Bernoulli}) {
    CAPTURE(static_cast<int>(dist));
    const double p1 = dist == Distribution::Bernoulli ? 0.4 : 0.0;
    omp_set_num_threads(2);
    const auto first = fill_floats(n, dist, p1, 1.0, st);
    const auto again = fill_floats(n, dist, p1, 1.0, st);
    omp_set_num_threads(1);
    const auto single = fill_floats(n, dist, p1, 1.0, st);
    CHECK(bitwise_equal(first, again));
    CHECK(bitwise_equal(first, single));

    omp_set_num_threads(2);
    const auto ints_two = fill_ints(n, dist, p1, dist == Distribution::Uniform ? 1000.0 : 1.0, st);
    omp_set_num_threads(1);
    const auto ints_one = fill_ints(n, dist, p1, dist == Distribution::Uniform ? 1000.0 : 1.0, st);
    CHECK(ints_two == ints_one);
  }
}

TEST_CASE("random: a fill at a later offset equals the tail of an earlier fill") {
  const PhiloxState early{77, 5, 10};
  for (const Distribution dist : {Distribution::Uniform, Distribution::Normal, Distribution::Rademacher,
                                  Distribution::Bernoulli}) {
    CAPTURE(static_cast<int>(dist));
    const double p1 = dist == Distribution::Bernoulli ? 0.3 : 0.0;
    const auto whole = fill_floats(4003, dist, p1, 1.0, early);
    for (const uint64_t skip_blocks : {uint64_t{1}, uint64_t{3}, uint64_t{250}}) {
      CAPTURE(skip_blocks);
      const PhiloxState later{early.seed, early.stream, early.offset + skip_blocks};
      const int64_t skipped = 4 * static_cast<int64_t>(skip_blocks);
      const auto tail = fill_floats(4003 - skipped, dist, p1, 1.0, later);
      const std::vector<float> expected(whole.begin() + skipped, whole.end());
      CHECK(bitwise_equal(tail, expected));
    }
  }
  // A short fill is a prefix of a longer one: the partial last block takes its first lanes.
  const auto longer = fill_floats(20, Distribution::Normal, 0.0, 1.0, early);
  const auto shorter = fill_floats(7, Distribution::Normal, 0.0, 1.0, early);
  CHECK(bitwise_equal(shorter, std::vector<float>(longer.begin(), longer.begin() + 7)));
}

TEST_CASE("random: different streams and seeds give different values") {
  const int64_t n = 1000;
  const auto base = fill_floats(n, Distribution::Uniform, 0.0, 1.0, {1, 0, 0});
  const auto other_stream = fill_floats(n, Distribution::Uniform, 0.0, 1.0, {1, 1, 0});
  const auto other_seed = fill_floats(n, Distribution::Uniform, 0.0, 1.0, {2, 0, 0});
  const auto high_seed = fill_floats(n, Distribution::Uniform, 0.0, 1.0, {1ull | (1ull << 40), 0, 0});
  const auto high_stream = fill_floats(n, Distribution::Uniform, 0.0, 1.0, {1, 1ull << 40, 0});
  auto count_equal = [&](const std::vector<float>& a, const std::vector<float>& b) {
    int64_t same = 0;
    for (size_t i = 0; i < a.size(); ++i) same += a[i] == b[i];
    return same;
  };
  // Chance coincidences of 24-bit values: expected 1000 / 2^24 per pair.
  CHECK(count_equal(base, other_stream) <= 2);
  CHECK(count_equal(base, other_seed) <= 2);
  CHECK(count_equal(base, high_seed) <= 2);
  CHECK(count_equal(base, high_stream) <= 2);
}

TEST_CASE("random: uniform statistics") {
  const auto v = fill_floats(kSamples, Distribution::Uniform, 0.0, 1.0, {2024, 0, 0});
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  CHECK(*lo >= 0.0f);
  CHECK(*hi < 1.0f);
  const Moments m = moments(v);
  CHECK(std::fabs(m.mean - 0.5) < 0.002);
  CHECK(std::fabs(m.var - 1.0 / 12.0) < 0.002);

  const auto ranged = fill_floats(kSamples, Distribution::Uniform, -3.0, 5.0, {2024, 1, 0});
  const auto [rlo, rhi] = std::minmax_element(ranged.begin(), ranged.end());
  CHECK(*rlo >= -3.0f);
  CHECK(*rhi < 5.0f);
  const Moments rm = moments(ranged);
  CHECK(std::fabs(rm.mean - 1.0) < 0.02);
  CHECK(std::fabs(rm.var - 64.0 / 12.0) < 0.05);
}

TEST_CASE("random: uniform never reaches hi even when rounding would") {
  // 2^-24 below 1 times 50000 rounds up to 50000 in float; the clamp must keep results below hi.
  const float v = mn::philox_uniform_range(1.0f - std::ldexp(1.0f, -24), 0.0f, 50000.0f, 50000.0f);
  CHECK(v < 50000.0f);
  const auto many = fill_floats(kSamples, Distribution::Uniform, 0.0, 50000.0, {3, 0, 0});
  CHECK(*std::max_element(many.begin(), many.end()) < 50000.0f);
  // lo == hi is a constant fill.
  const auto constant = fill_floats(9, Distribution::Uniform, 2.5, 2.5, {3, 0, 0});
  for (const float x : constant) CHECK(x == 2.5f);
}

TEST_CASE("random: normal statistics and parameters") {
  const auto v = fill_floats(kSamples, Distribution::Normal, 0.0, 1.0, {31337, 0, 0});
  const Moments m = moments(v);
  CHECK(std::fabs(m.mean) < 0.005);
  CHECK(std::fabs(std::sqrt(m.var) - 1.0) < 0.005);
  CHECK(std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); }));

  const auto shifted = fill_floats(kSamples, Distribution::Normal, 3.0, 2.0, {31337, 1, 0});
  const Moments sm = moments(shifted);
  CHECK(std::fabs(sm.mean - 3.0) < 0.01);
  CHECK(std::fabs(std::sqrt(sm.var) - 2.0) < 0.01);

  // Same counters, different parameters: an exact affine image of the standard draw.
  const auto standard = fill_floats(16, Distribution::Normal, 0.0, 1.0, {5, 0, 0});
  const auto affine = fill_floats(16, Distribution::Normal, 3.0, 2.0, {5, 0, 0});
  for (size_t i = 0; i < 16; ++i) CHECK(affine[i] == std::fmaf(2.0f, standard[i], 3.0f));

  const auto zero_std = fill_floats(8, Distribution::Normal, -1.5, 0.0, {5, 0, 0});
  for (const float x : zero_std) CHECK(x == -1.5f);
}

TEST_CASE("random: rademacher is +-1 with mean 0") {
  const auto v = fill_floats(kSamples, Distribution::Rademacher, 0.0, 0.0, {8, 0, 0});
  CHECK(std::all_of(v.begin(), v.end(), [](float x) { return x == 1.0f || x == -1.0f; }));
  CHECK(std::fabs(moments(v).mean) < 0.005);
  const auto ints = fill_ints(kSamples, Distribution::Rademacher, 0.0, 0.0, {8, 0, 0});
  CHECK(std::equal(ints.begin(), ints.end(), v.begin(), same_value));
}

TEST_CASE("random: bernoulli(p) mean and edge probabilities") {
  const auto v = fill_floats(kSamples, Distribution::Bernoulli, 0.3, 0.0, {9, 0, 0});
  CHECK(std::all_of(v.begin(), v.end(), [](float x) { return x == 0.0f || x == 1.0f; }));
  CHECK(std::fabs(moments(v).mean - 0.3) < 0.003);
  const auto ints = fill_ints(kSamples, Distribution::Bernoulli, 0.3, 0.0, {9, 0, 0});
  CHECK(std::equal(ints.begin(), ints.end(), v.begin(), same_value));

  const auto never = fill_floats(10'000, Distribution::Bernoulli, 0.0, 0.0, {9, 0, 0});
  const auto always = fill_floats(10'000, Distribution::Bernoulli, 1.0, 0.0, {9, 0, 0});
  CHECK(std::count(never.begin(), never.end(), 0.0f) == 10'000);
  CHECK(std::count(always.begin(), always.end(), 1.0f) == 10'000);
}

TEST_CASE("random: int64 uniform is floor of [lo, hi) (randint)") {
  const auto v = fill_ints(kSamples, Distribution::Uniform, 0.0, 10.0, {11, 0, 0});
  std::vector<int64_t> counts(10, 0);
  REQUIRE(std::all_of(v.begin(), v.end(), [](int64_t x) { return x >= 0 && x < 10; }));
  for (const int64_t x : v) ++counts[static_cast<size_t>(x)];
  for (const int64_t c : counts) CHECK(std::fabs(static_cast<double>(c) / kSamples - 0.1) < 0.003);

  const auto negative = fill_ints(10'000, Distribution::Uniform, -3.0, 2.0, {11, 1, 0});
  const std::set<int64_t> seen(negative.begin(), negative.end());
  CHECK(seen == std::set<int64_t>{-3, -2, -1, 0, 1});

  // A range far beyond float precision still reaches its top and stays below hi.
  const double big = 1e12;
  const auto wide = fill_ints(kSamples, Distribution::Uniform, 0.0, big, {11, 2, 0});
  const int64_t top = *std::max_element(wide.begin(), wide.end());
  CHECK(top < static_cast<int64_t>(big));
  CHECK(top > static_cast<int64_t>(big * 0.999));
}

TEST_CASE("random: generator reserve advances by ceil(n/4) and manual_seed resets") {
  mn::Generator gen(123, 9);
  CHECK(gen.seed() == 123);
  CHECK(gen.stream() == 9);
  CHECK(gen.offset() == 0);
  PhiloxState st = gen.reserve(10);
  CHECK(st.seed == 123);
  CHECK(st.stream == 9);
  CHECK(st.offset == 0);
  CHECK(gen.offset() == 3);
  st = gen.reserve(4);
  CHECK(st.offset == 3);
  CHECK(gen.offset() == 4);
  st = gen.reserve(0);
  CHECK(st.offset == 4);
  CHECK(gen.offset() == 4);
  st = gen.reserve(1);
  CHECK(gen.offset() == 5);
  gen.set_offset(100);
  CHECK(gen.reserve(5).offset == 100);
  CHECK(gen.offset() == 102);
  gen.manual_seed(77);
  CHECK(gen.seed() == 77);
  CHECK(gen.offset() == 0);
  CHECK(gen.stream() == 9);
  CHECK(mn::philox_blocks(0) == 0);
  CHECK(mn::philox_blocks(1) == 1);
  CHECK(mn::philox_blocks(4) == 1);
  CHECK(mn::philox_blocks(5) == 2);
  CHECK_THROWS_AS(gen.reserve(-1), mn::ValueError);
}

TEST_CASE("random: consecutive reservations never overlap and replay after reseed") {
  mn::Generator gen(5);
  const auto a = fill_floats(6, Distribution::Uniform, 0.0, 1.0, gen.reserve(6));
  const auto b = fill_floats(6, Distribution::Uniform, 0.0, 1.0, gen.reserve(6));
  CHECK_FALSE(bitwise_equal(a, b));
  gen.manual_seed(5);
  CHECK(bitwise_equal(a, fill_floats(6, Distribution::Uniform, 0.0, 1.0, gen.reserve(6))));
}

TEST_CASE("random: default generator and global manual_seed") {
  mn::Generator& gen = mn::default_generator();
  CHECK(&gen == &mn::default_generator());
  gen.reserve(40);
  mn::manual_seed(2718);
  CHECK(gen.seed() == 2718);
  CHECK(gen.offset() == 0);
  const auto first = fill_floats(8, Distribution::Normal, 0.0, 1.0, gen.reserve(8));
  mn::manual_seed(2718);
  CHECK(bitwise_equal(first, fill_floats(8, Distribution::Normal, 0.0, 1.0, gen.reserve(8))));
}

TEST_CASE("random: stream_key is FNV-1a 64") {
  CHECK(mn::stream_key("") == 0xcbf29ce484222325ull);
  CHECK(mn::stream_key("abc") == 0xe71fa2190541574bull);
  CHECK(mn::stream_key("a") != mn::stream_key("b"));
  CHECK(mn::stream_key("layer.0") == mn::stream_key("layer.0"));
}

TEST_CASE("random: bad arguments throw ValueError naming the argument") {
  std::vector<float> out(4);
  std::vector<int64_t> ints(4);
  const PhiloxState st{};
  auto message_of = [&](Distribution dist, double p1, double p2) -> std::string {
    try {
      mn::philox_fill(out.data(), 4, dist, p1, p2, st);
    } catch (const mn::ValueError& e) {
      return e.what();
    }
    return "";
  };
  const std::string bern = message_of(Distribution::Bernoulli, 1.5, 0.0);
  CHECK(bern.find("p") != std::string::npos);
  CHECK(bern.find("[0, 1]") != std::string::npos);
  CHECK(bern.find("1.5") != std::string::npos);
  CHECK(message_of(Distribution::Bernoulli, -0.1, 0.0).find("-0.1") != std::string::npos);
  CHECK_FALSE(message_of(Distribution::Bernoulli, std::nan(""), 0.0).empty());
  const std::string normal = message_of(Distribution::Normal, 0.0, -2.0);
  CHECK(normal.find("std") != std::string::npos);
  CHECK(normal.find("-2") != std::string::npos);
  const std::string uniform = message_of(Distribution::Uniform, 3.0, 1.0);
  CHECK(uniform.find("lo") != std::string::npos);
  CHECK(uniform.find("hi") != std::string::npos);
  CHECK_FALSE(message_of(Distribution::Uniform, 0.0, INFINITY).empty());
  CHECK(message_of(Distribution::Rademacher, 123.0, -4.0).empty());

  CHECK_THROWS_AS(mn::philox_fill(out.data(), -1, Distribution::Uniform, 0.0, 1.0, st), mn::ValueError);
  CHECK_THROWS_AS(mn::philox_fill(static_cast<float*>(nullptr), 4, Distribution::Uniform, 0.0, 1.0, st),
                  mn::ValueError);
  CHECK_NOTHROW(mn::philox_fill(static_cast<float*>(nullptr), 0, Distribution::Uniform, 0.0, 1.0, st));
  CHECK_THROWS_AS(mn::philox_fill(ints.data(), 4, Distribution::Uniform, 0.0, 1e300, st), mn::ValueError);
  CHECK_THROWS_AS(mn::philox_fill(ints.data(), 4, Distribution::Normal, 0.0, 1e300, st), mn::ValueError);
  CHECK_THROWS_AS(mn::check_distribution_params(Distribution::Bernoulli, 2.0, 0.0), mn::ValueError);
}
