// safetensors: round trips, the exact bytes of a tiny file, decoding of every stored dtype from
// hand-built buffers, every malformed-file case (each an IOError naming the problem), writer
// argument errors, and atomic save.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/factories.h"
#include "nn/layers.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

namespace st = mn::safetensors;
namespace fs = std::filesystem;
using mn::Tensor;

namespace {

using Bytes = std::vector<uint8_t>;

// 8-byte little-endian header length, the header text, then the data buffer.
Bytes make_file(const std::string& header, const Bytes& buffer = {}) {
  Bytes out(8 + header.size() + buffer.size());
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(buffer.begin(), buffer.end(), out.begin() + 8 + static_cast<std::ptrdiff_t>(header.size()));
  return out;
}

Bytes le_u16(std::initializer_list<uint16_t> values) {
  Bytes out;
  for (uint16_t v : values) {
    out.push_back(static_cast<uint8_t>(v));
    out.push_back(static_cast<uint8_t>(v >> 8));
  }
  return out;
}

template <class T>
Bytes raw_le(std::initializer_list<T> values) {  // the host is little-endian (x86-64)
  Bytes out(values.size() * sizeof(T));
  std::memcpy(out.data(), std::data(values), out.size());
  return out;
}

std::string entry_json(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t begin,
                       uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

// A JSON object text from member texts, e.g. header({entry_json(...), entry_json(...)}). Appends
// rather than chaining operator+, which trips a GCC 12 -Wrestrict false positive.
std::string header(std::initializer_list<std::string> members) {
  std::string text = "{";
  for (const std::string& m : members) {
    if (text.size() > 1) text += ',';
    text += m;
  }
  text += '}';
  return text;
}

// Parses a one-tensor file holding buffer as dtype with the given shape.
st::File parse_single(const std::string& dtype, const std::string& shape, const Bytes& buffer) {
  const Bytes file = make_file(header({entry_json("x", dtype, shape, 0, buffer.size())}), buffer);
  return st::parse(file.data(), file.size(), "single");
}

// The IOError message parse() gives for bytes, or a marker when it throws something else or nothing.
std::string parse_failure(const Bytes& bytes) {
  try {
    st::parse(bytes.data(), bytes.size(), "bad.safetensors");
  } catch (const mn::IOError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not an IOError: ") + e.what() + ">";
  }
  return "<no error>";
}

void check_parse_fails(const Bytes& bytes, const std::string& expected_substring) {
  const std::string message = parse_failure(bytes);
  INFO("message: " << message);
  INFO("expected to contain: " << expected_substring);
  CHECK(message.rfind("bad.safetensors: ", 0) == 0);
  CHECK(message.find(expected_substring) != std::string::npos);
}

void check_parse_fails(const std::string& header, const Bytes& buffer, const std::string& expected_substring) {
  check_parse_fails(make_file(header, buffer), expected_substring);
}

// A scratch directory removed at the end of each test.
struct ScratchDir {
  fs::path path;
  ScratchDir() {
    static int counter = 0;
    path = fs::temp_directory_path() / ("mn_safetensors_test_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::vector<std::string> listing(const fs::path& dir) const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Round trips

TEST_CASE("safetensors: round trip of f32, i64, 0-d and empty tensors with metadata") {
  Tensor weights = mn::from_vector(std::vector<float>{1.5f, -2.0f, 0.0f, 3.25f, 1e-30f, -7.0f}, {2, 3});
  Tensor labels = mn::from_vector(std::vector<int64_t>{0, -1, std::numeric_limits<int64_t>::max(),
                                                       std::numeric_limits<int64_t>::min()},
                                  {4});
  Tensor scalar = mn::scalar_tensor(0.5);
  Tensor nothing = mn::zeros({0, 3});
  const st::StringMap metadata{{"format", "pt"}, {"note", "quote \" and unicode \xc3\xa9"}};
  const Bytes bytes = st::serialize({{"w", weights}, {"labels", labels}, {"scalar", scalar}, {"empty", nothing}},
                                    metadata);
  CHECK(bytes[0] % 8 == 0);  // 8 + N is a multiple of 8, so the data buffer is 8-byte aligned
  const st::File file = st::parse(bytes.data(), bytes.size());

  REQUIRE(file.tensors.size() == 4);
  CHECK(file.tensors[0].name == "w");  // header order is the given order
  CHECK(file.tensors[1].name == "labels");
  CHECK(file.tensors[2].name == "scalar");
  CHECK(file.tensors[3].name == "empty");
  CHECK(file.metadata == metadata);

  CHECK(file.entry("w").dtype == "F32");
  CHECK(file.at("w").dtype() == mn::DType::f32);
  CHECK(file.at("w").sizes() == mn::Shape{2, 3});
  CHECK(file.at("w").to_vector<float>() == weights.to_vector<float>());

  CHECK(file.entry("labels").dtype == "I64");
  CHECK(file.at("labels").dtype() == mn::DType::i64);
  CHECK(file.at("labels").to_vector<int64_t>() == labels.to_vector<int64_t>());

  CHECK(file.at("scalar").dim() == 0);
  CHECK(file.at("scalar").item() == 0.5);

  CHECK(file.at("empty").sizes() == mn::Shape{0, 3});
  CHECK(file.at("empty").numel() == 0);

  CHECK(file.contains("w"));
  CHECK_FALSE(file.contains("missing"));
  CHECK_THROWS_AS(file.at("missing"), mn::KeyError);
  try {
    file.at("missing");
  } catch (const mn::KeyError& e) {
    CHECK(std::string(e.what()).find("'missing'") != std::string::npos);
    CHECK(std::string(e.what()).find("'labels'") != std::string::npos);  // lists what is there
  }
}

TEST_CASE("safetensors: non-contiguous tensors are written in row-major order") {
  Tensor base = mn::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor transposed = base.t();  // [3, 2]: 0 3 1 4 2 5
  REQUIRE_FALSE(transposed.is_contiguous());
  Tensor strided = base.slice(1, 0, 3, 2);  // [2, 2]: 0 2 3 5
  Tensor ints = mn::from_vector(std::vector<int64_t>{10, 11, 12, 13, 14, 15}, {3, 2}).t();  // 10 12 14 11 13 15
  const Bytes bytes = st::serialize({{"t", transposed}, {"s", strided}, {"i", ints}});
  const st::File file = st::parse(bytes.data(), bytes.size());
  CHECK(file.at("t").sizes() == mn::Shape{3, 2});
  CHECK(file.at("t").to_vector<float>() == std::vector<float>{0, 3, 1, 4, 2, 5});
  CHECK(file.at("s").to_vector<float>() == std::vector<float>{0, 2, 3, 5});
  CHECK(file.at("i").to_vector<int64_t>() == std::vector<int64_t>{10, 12, 14, 11, 13, 15});
}

TEST_CASE("safetensors: the bytes of a tiny file") {
  Tensor a = mn::from_vector(std::vector<float>{1.0f, 2.0f}, {2});
  Tensor b = mn::full({}, 7.0, mn::DType::i64);
  const Bytes bytes = st::serialize({{"a", a}, {"b", b}});
  // 107 bytes of JSON; 8 + 107 = 115, so 5 spaces pad the header to N = 112 and the buffer starts
  // at offset 120.
  const std::string json =
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[8,16]}}";
  REQUIRE(json.size() == 107);
  Bytes expected = {112, 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), json.begin(), json.end());
  expected.insert(expected.end(), 5, ' ');
  const Bytes buffer = {0x00, 0x00, 0x80, 0x3f,  // 1.0f
                        0x00, 0x00, 0x00, 0x40,  // 2.0f
                        0x07, 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), buffer.begin(), buffer.end());
  CHECK(bytes.size() == 136);
  CHECK(bytes == expected);

  // With metadata: 79 bytes of JSON, 8 + 79 = 87, one space of padding.
  const Bytes with_metadata = st::serialize({{"a", a}}, {{"k", "v"}});
  const std::string json2 = "{\"__metadata__\":{\"k\":\"v\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} ";
  CHECK(with_metadata[0] == 80);
  CHECK(std::string(with_metadata.begin() + 8, with_metadata.begin() + 88) == json2);
  CHECK(with_metadata.size() == 96);

  // No tensors at all is a valid (if useless) file.
  const Bytes empty_file = st::serialize({});
  CHECK(empty_file == Bytes{8, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' ', ' ', ' ', ' ', ' '});
  CHECK(st::parse(empty_file.data(), empty_file.size()).tensors.empty());
}

// ---------------------------------------------------------------------------------------------
// Decoding the dtypes the engine does not hold

TEST_CASE("safetensors: F16 decoding is exact, subnormals, infinities and NaN included") {
  const st::File file = parse_single(
      "F16", "[12]", le_u16({0x0001, 0x7c00, 0xc000, 0x3c00, 0xfc00, 0x7e00, 0x8000, 0x03ff, 0x0400, 0x7bff, 0x3555, 0x8001}));
  CHECK(file.entry("x").dtype == "F16");
  const std::vector<float> v = file.at("x").to_vector<float>();
  CHECK(v[0] == std::ldexp(1.0f, -24));  // smallest subnormal
  CHECK(v[1] == std::numeric_limits<float>::infinity());
  CHECK(v[2] == -2.0f);
  CHECK(v[3] == 1.0f);
  CHECK(v[4] == -std::numeric_limits<float>::infinity());
  CHECK(std::isnan(v[5]));
  CHECK(v[6] == 0.0f);
  CHECK(std::signbit(v[6]));
  CHECK(v[7] == 1023 * std::ldexp(1.0f, -24));  // largest subnormal
  CHECK(v[8] == std::ldexp(1.0f, -14));          // smallest normal
  CHECK(v[9] == 65504.0f);
  CHECK(v[10] == 0x555 * std::ldexp(1.0f, -12));  // 0.333251953125
  CHECK(v[11] == -std::ldexp(1.0f, -24));
}

TEST_CASE("safetensors: BF16 and F64 decoding") {
  const std::vector<float> bf = parse_single("BF16", "[2,2]", le_u16({0x3f80, 0xc000, 0x7f80, 0x0001})).at("x").to_vector<float>();
  CHECK(bf[0] == 1.0f);
  CHECK(bf[1] == -2.0f);
  CHECK(bf[2] == std::numeric_limits<float>::infinity());
  CHECK(bf[3] == std::bit_cast<float>(uint32_t{0x00010000}));  // a float subnormal, kept exactly

  const st::File f64 = parse_single("F64", "[4]", raw_le<double>({1.5, -0.25, 1e300, 0.1}));
  CHECK(f64.entry("x").dtype == "F64");
  const std::vector<float> d = f64.at("x").to_vector<float>();
  CHECK(d[0] == 1.5f);
  CHECK(d[1] == -0.25f);
  CHECK(d[2] == std::numeric_limits<float>::infinity());  // beyond float range
  CHECK(d[3] == 0.1f);                                      // rounded to the nearest float
}

TEST_CASE("safetensors: integer and BOOL decoding to i64") {
  auto ints = [](const std::string& dtype, const std::string& shape, const Bytes& buffer) {
    const st::File f = parse_single(dtype, shape, buffer);
    CHECK(f.at("x").dtype() == mn::DType::i64);
    CHECK(f.entry("x").dtype == dtype);
    return f.at("x").to_vector<int64_t>();
  };
  CHECK(ints("I32", "[3]", raw_le<int32_t>({-1, 2147483647, -2147483647 - 1})) ==
        std::vector<int64_t>{-1, 2147483647, -2147483648LL});
  CHECK(ints("I16", "[2]", raw_le<int16_t>({-32768, 1234})) == std::vector<int64_t>{-32768, 1234});
  CHECK(ints("I8", "[2]", Bytes{0x80, 0x7f}) == std::vector<int64_t>{-128, 127});
  CHECK(ints("U8", "[3]", Bytes{255, 0, 7}) == std::vector<int64_t>{255, 0, 7});
  CHECK(ints("U16", "[1]", raw_le<uint16_t>({65535})) == std::vector<int64_t>{65535});
  CHECK(ints("U32", "[1]", raw_le<uint32_t>({4294967295u})) == std::vector<int64_t>{4294967295LL});
  CHECK(ints("U64", "[1]", raw_le<uint64_t>({1ull << 62})) == std::vector<int64_t>{1LL << 62});
  CHECK(ints("BOOL", "[2,2]", Bytes{0, 1, 1, 0}) == std::vector<int64_t>{0, 1, 1, 0});
  CHECK(ints("I64", "[1]", raw_le<int64_t>({-5})) == std::vector<int64_t>{-5});
  // A foreign writer need not align the buffer: a 1-byte tensor first leaves the I64 one at an odd offset.
  Bytes buffer = {3};
  const Bytes i64 = raw_le<int64_t>({-9});
  buffer.insert(buffer.end(), i64.begin(), i64.end());
  const Bytes file = make_file(header({entry_json("u", "U8", "[1]", 0, 1), entry_json("v", "I64", "[1]", 1, 9)}),
                               buffer);
  const st::File parsed = st::parse(file.data(), file.size());
  CHECK(parsed.at("u").item() == 3);
  CHECK(parsed.at("v").item() == -9);
}

// ---------------------------------------------------------------------------------------------
// Writer dtype overrides

TEST_CASE("safetensors: half and bfloat16 conversions round to nearest even and survive a round trip") {
  // Every half and bfloat16 pattern converts to float and back unchanged (NaNs stay NaN).
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = st::half_bits_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(st::half_bits_to_float(st::float_to_half_bits(f))));
      continue;
    }
    if (st::float_to_half_bits(f) != h) FAIL_CHECK("half 0x" << std::hex << h << " does not round trip");
    const float g = st::bfloat16_bits_to_float(static_cast<uint16_t>(h));
    if (!std::isnan(g) && st::float_to_bfloat16_bits(g) != h) FAIL_CHECK("bf16 0x" << std::hex << h << " does not round trip");
  }
  const float ulp_half = std::ldexp(1.0f, -10), ulp_bf16 = std::ldexp(1.0f, -7);
  CHECK(st::float_to_half_bits(1.0f + ulp_half / 2) == 0x3c00);      // tie, to even (down)
  CHECK(st::float_to_half_bits(1.0f + 1.5f * ulp_half) == 0x3c02);   // tie, to even (up)
  CHECK(st::float_to_half_bits(1.0f + 0.75f * ulp_half) == 0x3c01);  // above the tie
  CHECK(st::float_to_half_bits(65519.0f) == 0x7bff);
  CHECK(st::float_to_half_bits(65520.0f) == 0x7c00);  // overflow to inf
  CHECK(st::float_to_half_bits(-1e10f) == 0xfc00);
  CHECK(st::float_to_half_bits(1e-8f) == 0x0000);                        // below half the smallest subnormal
  CHECK(st::float_to_half_bits(std::ldexp(1.0f, -25)) == 0x0000);        // tie with zero, to even
  CHECK(st::float_to_half_bits(std::ldexp(1.5f, -25)) == 0x0001);
  CHECK(st::float_to_half_bits(std::ldexp(1.5f, -24)) == 0x0002);        // tie, to even
  CHECK(st::float_to_half_bits(std::ldexp(1023.5f, -24)) == 0x0400);     // carries into the smallest normal
  CHECK(std::isnan(st::half_bits_to_float(st::float_to_half_bits(std::nanf("")))));
  CHECK(st::float_to_bfloat16_bits(1.0f + ulp_bf16 / 2) == 0x3f80);
  CHECK(st::float_to_bfloat16_bits(1.0f + 1.5f * ulp_bf16) == 0x3f82);
  CHECK(std::isnan(st::bfloat16_bits_to_float(st::float_to_bfloat16_bits(std::nanf("")))));
  CHECK(st::float_to_bfloat16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // rounds to inf
}

TEST_CASE("safetensors: per-tensor output dtypes") {
  Tensor f = mn::from_vector(std::vector<float>{1.0f, -2.0f, 0.1f, 65520.0f}, {4});
  Tensor i = mn::from_vector(std::vector<int64_t>{0, 255, 7}, {3});
  Tensor j = mn::from_vector(std::vector<int64_t>{-2147483648LL, 2147483647}, {2});
  const Bytes bytes = st::serialize({{"h", f}, {"b", f}, {"d", f}, {"f", f}, {"u", i}, {"i", j}}, {},
                                    {{"h", "F16"}, {"b", "BF16"}, {"d", "F64"}, {"u", "U8"}, {"i", "I32"}});
  const st::File file = st::parse(bytes.data(), bytes.size());
  CHECK(file.entry("h").dtype == "F16");
  CHECK(file.entry("b").dtype == "BF16");
  CHECK(file.entry("d").dtype == "F64");
  CHECK(file.entry("f").dtype == "F32");
  CHECK(file.entry("u").dtype == "U8");
  CHECK(file.entry("i").dtype == "I32");
  CHECK(file.at("h").to_vector<float>() ==
        std::vector<float>{1.0f, -2.0f, st::half_bits_to_float(st::float_to_half_bits(0.1f)),
                           std::numeric_limits<float>::infinity()});
  CHECK(file.at("b").to_vector<float>()[2] == st::bfloat16_bits_to_float(st::float_to_bfloat16_bits(0.1f)));
  CHECK(file.at("d").to_vector<float>() == f.to_vector<float>());
  CHECK(file.at("u").to_vector<int64_t>() == i.to_vector<int64_t>());
  CHECK(file.at("i").to_vector<int64_t>() == j.to_vector<int64_t>());
  // F16 is 2 bytes per element: "h" spans [0, 8).
  CHECK(std::string(bytes.begin() + 8, bytes.end()).find("\"h\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[0,8]}") !=
        std::string::npos);
}

TEST_CASE("safetensors: writer argument errors are ValueErrors") {
  Tensor f = mn::from_vector(std::vector<float>{1.0f}, {1});
  Tensor big = mn::from_vector(std::vector<int64_t>{1, 256}, {2});
  Tensor negative = mn::from_vector(std::vector<int64_t>{-1}, {1});
  Tensor wide = mn::from_vector(std::vector<int64_t>{1LL << 31}, {1});
  CHECK_THROWS_AS(st::serialize({{"", f}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", f}, {"a", f}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"__metadata__", f}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", Tensor()}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", f}}, {}, {{"a", "I32"}}), mn::ValueError);   // float as int
  CHECK_THROWS_AS(st::serialize({{"a", big}}, {}, {{"a", "F16"}}), mn::ValueError);  // int as float
  CHECK_THROWS_AS(st::serialize({{"a", f}}, {}, {{"a", "F8_E4M3"}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", f}}, {}, {{"typo", "F16"}}), mn::ValueError);
  CHECK_THROWS_WITH_AS(st::serialize({{"a", big}}, {}, {{"a", "U8"}}),
                       doctest::Contains("element 1 is 256, outside the U8 range [0, 255]"), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", negative}}, {}, {{"a", "U8"}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", wide}}, {}, {{"a", "I32"}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"bad \xff utf8", f}}), mn::ValueError);
  CHECK_THROWS_AS(st::serialize({{"a", f}}, {{"k", "\xc3"}}), mn::ValueError);
}

// ---------------------------------------------------------------------------------------------
// Malformed files: every one an IOError naming the file and the problem

TEST_CASE("safetensors: truncated files") {
  check_parse_fails(Bytes{}, "truncated: 0 bytes");
  check_parse_fails(Bytes{1, 2, 3}, "truncated: 3 bytes");
  Bytes past_end = make_file("{}");
  past_end[0] = 100;  // claims 100 header bytes, 2 follow
  check_parse_fails(past_end, "header length 100 (at offset 0) runs past the end of the file; only 2 bytes follow");
  // Data shorter than the offsets promise.
  check_parse_fails(header({entry_json("w", "F32", "[2]", 0, 8)}), Bytes{0, 0, 0, 0},
                    "tensor 'w': data_offsets [0, 8] end at file offset");
  check_parse_fails(header({entry_json("w", "F32", "[2]", 0, 8)}), Bytes{0, 0, 0, 0}, "4-byte data buffer");
}

TEST_CASE("safetensors: header length over the 100 MB limit") {
  Bytes huge = make_file("{}");
  const uint64_t n = 100'000'001;
  for (int i = 0; i < 8; ++i) huge[i] = static_cast<uint8_t>(n >> (8 * i));
  check_parse_fails(huge, "header length 100000001 (at offset 0) exceeds the limit of 100000000 bytes");
  for (int i = 0; i < 8; ++i) huge[i] = 0xff;
  check_parse_fails(huge, "exceeds the limit");
}

TEST_CASE("safetensors: bad JSON and non-object headers") {
  check_parse_fails("{\"a\":", {}, "bad JSON header");
  check_parse_fails("{\"a\":1,}", {}, "bad JSON header");
  check_parse_fails("{} x", {}, "bad JSON header");
  check_parse_fails("{\"a\":1e999}", {}, "bad JSON header");
  check_parse_fails("{\"\xff\":1}", {}, "bad JSON header");  // invalid UTF-8
  check_parse_fails("[1,2]", {}, "header is not a JSON object: expected '{' at offset 8, got byte 0x5b");
  check_parse_fails(" {}", {}, "header is not a JSON object");
  check_parse_fails("", {}, "an empty header");
  check_parse_fails("{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}", {}, "nests deeper than 16 levels");
  Bytes with_nul = make_file(std::string("{}\0", 3));
  check_parse_fails(with_nul, "bad JSON header: NUL byte at offset 10");
}

TEST_CASE("safetensors: bad dtype, shape and header entries") {
  const Bytes four = {0, 0, 0, 0};
  check_parse_fails(header({entry_json("w", "Q7", "[1]", 0, 4)}), four, "tensor 'w': unknown or unsupported dtype 'Q7'");
  check_parse_fails(header({entry_json("w", "C64", "[1]", 0, 4)}), four, "unsupported dtype 'C64'");
  check_parse_fails("{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,4]}}", four, "dtype is an integer, expected a string");
  check_parse_fails("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", four, "tensor 'w': header entry has no \"dtype\"");
  check_parse_fails("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", four, "has no \"shape\"");
  check_parse_fails("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", four, "has no \"data_offsets\"");
  check_parse_fails("{\"w\":5}", {}, "tensor 'w': header entry is an integer, expected an object");
  check_parse_fails(header({entry_json("w", "F32", "3", 0, 4)}), four, "tensor 'w': shape is an integer, expected an array");
  check_parse_fails(header({entry_json("w", "F32", "[-1]", 0, 4)}), four, "shape[0] is -1, expected a non-negative integer");
  check_parse_fails(header({entry_json("w", "F32", "[1.0]", 0, 4)}), four, "shape[0] is 1.0");
  check_parse_fails(header({entry_json("w", "F32", "[\"1\"]", 0, 4)}), four, "shape[0] is a string");
  check_parse_fails(header({entry_json("w", "F32", "[9223372036854775808]", 0, 4)}), four, "below 2^63");
  check_parse_fails(header({entry_json("w", "F32", "[1,1,1,1,1,1,1,1,1]", 0, 4)}), four, "9 dimensions");
  check_parse_fails(header({entry_json("w", "F32", "[4611686018427387904,4]", 0, 4)}), four, "more than 2^63 elements");
  // Empty, but the strides would still overflow.
  check_parse_fails(header({entry_json("w", "F32", "[4611686018427387904,0,4]", 0, 0)}), {}, "more than 2^63 elements");
  check_parse_fails(header({entry_json("w", "F64", "[4611686018427387904]", 0, 4)}), four, "needs more than 2^64 bytes");
  check_parse_fails("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", four, "expected [begin, end]");
  check_parse_fails("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{}}}", four, "expected [begin, end]");
  check_parse_fails("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", four, "data_offsets[0] is -4");
  check_parse_fails("{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,null]}}", four, "data_offsets[1] is null");
}

TEST_CASE("safetensors: offsets that do not tile the buffer") {
  const Bytes twelve(12, 0);
  check_parse_fails(header({entry_json("w", "F32", "[1]", 0, 1000)}), twelve,
                    "tensor 'w': data_offsets [0, 1000] end at file offset");
  check_parse_fails(header({entry_json("w", "F32", "[1]", 0, 1000)}), twelve, "past the end of the 12-byte data buffer");
  check_parse_fails(header({entry_json("w", "F32", "[0]", 8, 0)}), twelve, "data_offsets [8, 0] has begin > end");
  check_parse_fails(header({entry_json("w", "F32", "[3]", 0, 8)}), Bytes(8, 0),
                    "span 8 bytes, but shape [3] of F32 needs 3 x 4 = 12 bytes");
  check_parse_fails(header({entry_json("a", "F32", "[2]", 0, 8), entry_json("b", "F32", "[2]", 4, 12)}), twelve,
                    "tensor 'b' data_offsets [4, 12] overlap tensor 'a', which ends at 8");
  check_parse_fails(header({entry_json("a", "F32", "[1]", 0, 4), entry_json("b", "F32", "[1]", 8, 12)}), twelve,
                    "hole in the data buffer: bytes [4, 8)");
  check_parse_fails(header({entry_json("a", "F32", "[2]", 0, 8)}), twelve, "cover only 8");
  check_parse_fails("{}", Bytes{1}, "cover only 0");
  // Identical ranges overlap too.
  check_parse_fails(header({entry_json("a", "F32", "[1]", 0, 4), entry_json("b", "F32", "[1]", 0, 4)}), Bytes(4, 0),
                    "overlap");
  // Empty tensors may sit at any tensor boundary, the end of the buffer included.
  const Bytes ok = make_file(header({entry_json("a", "F32", "[1]", 0, 4), entry_json("e", "F32", "[0,5]", 4, 4), entry_json("z", "I64", "[0]", 0, 0)}),
                             Bytes(4, 0));
  CHECK(st::parse(ok.data(), ok.size()).tensors.size() == 3);
}

TEST_CASE("safetensors: duplicate names, bad metadata and bad values") {
  const Bytes eight(8, 0);
  check_parse_fails(header({entry_json("a", "F32", "[1]", 0, 4), entry_json("a", "F32", "[1]", 4, 8)}), eight,
                    "duplicate key 'a' in the header");
  check_parse_fails("{\"a\":{\"dtype\":\"F32\",\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}", Bytes(4, 0),
                    "duplicate key 'dtype' inside the header entry 'a'");
  check_parse_fails("{\"__metadata__\":{\"k\":1}}", {}, "__metadata__ value for key 'k' is an integer, expected a string");
  check_parse_fails("{\"__metadata__\":{\"k\":\"v\",\"j\":null}}", {}, "value for key 'j' is null");
  check_parse_fails("{\"__metadata__\":[\"k\"]}", {}, "__metadata__ is an array, expected an object of strings");
  check_parse_fails("{\"__metadata__\":{},\"__metadata__\":{}}", {}, "duplicate key '__metadata__'");
  check_parse_fails(header({entry_json("b", "BOOL", "[2]", 0, 2)}), Bytes{1, 2},
                    "tensor 'b': BOOL element 1 at file offset");
  check_parse_fails(header({entry_json("u", "U64", "[1]", 0, 8)}), raw_le<uint64_t>({1ull << 63}),
                    "U64 element 0 at file offset");
}

TEST_CASE("safetensors: the source name prefixes every parse error") {
  const Bytes bad = make_file("[]");
  CHECK_THROWS_WITH_AS(st::parse(bad.data(), bad.size(), "ckpt/model.safetensors"),
                       doctest::Contains("ckpt/model.safetensors: header is not a JSON object"), mn::IOError);
  CHECK_THROWS_WITH_AS(st::parse(bad.data(), bad.size()), doctest::Contains("<memory>: "), mn::IOError);
}

// ---------------------------------------------------------------------------------------------
// Files: load and atomic save

TEST_CASE("safetensors: save and load, replacing an existing file atomically") {
  ScratchDir scratch;
  const fs::path path = scratch.path / "nested" / "dir" / "model.safetensors";  // parents are created
  Tensor first = mn::from_vector(std::vector<float>{1, 2, 3}, {3});
  st::save(path.string(), {{"w", first}}, {{"step", "1"}});
  st::File loaded = st::load(path.string());
  CHECK(loaded.at("w").to_vector<float>() == std::vector<float>{1, 2, 3});
  CHECK(loaded.metadata.at("step") == "1");
  CHECK(read_bytes(path) == st::serialize({{"w", first}}, {{"step", "1"}}));

  Tensor second = mn::from_vector(std::vector<int64_t>{4, 5}, {2});
  st::save(path.string(), {{"v", second}}, {{"step", "2"}});
  loaded = st::load(path.string());
  CHECK_FALSE(loaded.contains("w"));
  CHECK(loaded.at("v").to_vector<int64_t>() == std::vector<int64_t>{4, 5});
  CHECK(scratch.listing(path.parent_path()) == std::vector<std::string>{"model.safetensors"});  // no temp files

  // A relative path without a directory part works too.
  const fs::path old_cwd = fs::current_path();
  fs::current_path(scratch.path);
  st::save("here.safetensors", {{"w", first}});
  CHECK(st::load("here.safetensors").contains("w"));
  fs::current_path(old_cwd);
}

TEST_CASE("safetensors: a failed save throws IOError, keeps the old file and leaves no temp file") {
  ScratchDir scratch;
  const fs::path good = scratch.path / "model.safetensors";
  Tensor t = mn::from_vector(std::vector<float>{1, 2}, {2});
  st::save(good.string(), {{"w", t}});
  const Bytes before = read_bytes(good);

  // The parent "directory" is a regular file.
  const fs::path under_file = good / "child.safetensors";
  CHECK_THROWS_WITH_AS(st::save(under_file.string(), {{"w", t}}), doctest::Contains("cannot create directory"),
                       mn::IOError);
  // The target is a directory: the temp file is written, then rename fails and the temp is removed.
  const fs::path dir_target = scratch.path / "occupied";
  fs::create_directories(dir_target / "inside");
  CHECK_THROWS_WITH_AS(st::save(dir_target.string(), {{"w", t}}), doctest::Contains("rename over"), mn::IOError);
  CHECK(fs::is_directory(dir_target / "inside"));
  // Bad arguments fail before the disk is touched.
  CHECK_THROWS_AS(st::save(good.string(), {{"w", t}, {"w", t}}), mn::ValueError);
  CHECK_THROWS_AS(st::save("", {{"w", t}}), mn::ValueError);

  CHECK(read_bytes(good) == before);
  CHECK(scratch.listing(scratch.path) == std::vector<std::string>{"model.safetensors", "occupied"});
}

TEST_CASE("safetensors: a save removes the temporaries a killed writer left, and no live writer's") {
  ScratchDir scratch;
  const fs::path path = scratch.path / "checkpoint.safetensors";
  // A process that has exited: its pid names no live process (until the system reuses it).
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  REQUIRE(::waitpid(child, nullptr, 0) == child);
  const std::string dead = "checkpoint.safetensors.tmp." + std::to_string(child) + ".0";
  const std::string live = "checkpoint.safetensors.tmp." + std::to_string(::getpid()) + ".999";
  for (const std::string& name : {dead, live, std::string("checkpoint.safetensors.tmp.notapid"),
                                  std::string("other.safetensors.tmp.1.0")})
    std::ofstream(scratch.path / name) << "partial";
  st::save(path.string(), {{"w", mn::from_vector(std::vector<float>{1}, {1})}});
  std::vector<std::string> kept{"checkpoint.safetensors", "checkpoint.safetensors.tmp.notapid", live,
                                "other.safetensors.tmp.1.0"};
  std::sort(kept.begin(), kept.end());
  CHECK(scratch.listing(scratch.path) == kept);
}

TEST_CASE("safetensors: load errors name the path") {
  ScratchDir scratch;
  const std::string missing = (scratch.path / "missing.safetensors").string();
  CHECK_THROWS_WITH_AS(st::load(missing), doctest::Contains(("not found: " + missing).c_str()), mn::IOError);
  CHECK_THROWS_WITH_AS(st::load(scratch.path.string()), doctest::Contains("is a directory"), mn::IOError);
  const fs::path corrupt = scratch.path / "corrupt.safetensors";
  {
    std::ofstream out(corrupt, std::ios::binary);
    out << "short";
  }
  CHECK_THROWS_WITH_AS(st::load(corrupt.string()), doctest::Contains((corrupt.string() + ": truncated: 5 bytes").c_str()),
                       mn::IOError);
  // A file written by hand (the python safetensors layout for one F16 tensor) loads.
  const Bytes hand = make_file(header({entry_json("h", "F16", "[2]", 0, 4)}), le_u16({0x3c00, 0xc000}));
  {
    std::ofstream out(scratch.path / "hand.safetensors", std::ios::binary);
    out.write(reinterpret_cast<const char*>(hand.data()), static_cast<std::streamsize>(hand.size()));
  }
  CHECK(st::load((scratch.path / "hand.safetensors").string()).at("h").to_vector<float>() == std::vector<float>{1, -2});
}

TEST_CASE("nn::save / nn::load: a module's weights through safetensors, strict by default") {
  mn::testing::TempDir dir("mn_serialize");
  const std::string path = (std::filesystem::path(dir.path()) / "w.safetensors").string();
  mn::manual_seed(1);
  auto make = [](int64_t hidden) {
    return std::make_shared<mn::nn::Sequential>(std::vector<mn::nn::ModulePtr>{
        std::make_shared<mn::nn::Linear>(3, hidden), std::make_shared<mn::nn::BatchNorm1d>(hidden),
        std::make_shared<mn::nn::Linear>(hidden, 2)});
  };
  auto net = make(4);
  mn::nn::save(*net, path);
  const st::File file = st::load(path);
  CHECK(file.metadata.at("format") == "pt");
  CHECK(file.state_dict().size() == net->state_dict().size());

  auto other = make(4);
  const auto skipped = mn::nn::load(*other, path);
  CHECK(skipped.missing.empty());
  CHECK(skipped.unexpected.empty());
  for (const auto& [name, t] : net->state_dict()) {
    INFO(name);
    const mn::Tensor got = other->state_dict().at(name);
    if (t.dtype() == mn::DType::f32) CHECK(got.to_vector<float>() == t.to_vector<float>());
    else CHECK(got.to_vector<int64_t>() == t.to_vector<int64_t>());
  }

  // The state dict and the file's tensors are one type in both directions.
  st::save(path, net->state_dict());
  other->load_state_dict(st::load(path).state_dict());

  // A file missing a name: strict refuses (naming the file and the name, changing nothing); non-strict
  // loads the rest and reports what it skipped.
  mn::nn::StateDict partial = net->state_dict();
  partial.erase("2.bias");
  partial["extra"] = mn::zeros({1});
  st::save(path, partial);
  auto fresh = make(4);
  const auto before = fresh->state_dict().at("0.weight").to_vector<float>();
  const std::string message = mn::testing::error_message([&] { mn::nn::load(*fresh, path); });
  CHECK(mn::testing::contains(message, path));
  CHECK(mn::testing::contains(message, "missing=[2.bias]"));
  CHECK(mn::testing::contains(message, "unexpected=[extra]"));
  CHECK(fresh->state_dict().at("0.weight").to_vector<float>() == before);
  const auto report = mn::nn::load(*fresh, path, /*strict=*/false);
  CHECK(report.missing == std::vector<std::string>{"2.bias"});
  CHECK(report.unexpected == std::vector<std::string>{"extra"});
  CHECK(fresh->state_dict().at("0.weight").to_vector<float>() == net->state_dict().at("0.weight").to_vector<float>());
  // A shape that differs is an error even when not strict.
  auto wider = make(5);
  CHECK(mn::testing::contains(mn::testing::error_message([&] { mn::nn::load(*wider, path, false); }), "mismatched"));
}
