// libFuzzer target for the safetensors reader. Every input must either parse or throw an mn::Error;
// any other exception, crash or sanitizer report is a bug. Inputs that parse must also survive a
// round trip: serialize() accepts what parse() produced and parsing that again gives the same
// names, dtypes, shapes, values and metadata. Built and run by tests/fuzz/run_fuzz.sh.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "nn/safetensors.h"

namespace {

namespace st = mn::safetensors;

[[noreturn]] void round_trip_bug(const std::string& what) {
  std::fprintf(stderr, "safetensors round trip mismatch: %s\n", what.c_str());
  std::abort();
}

// The writer offers these output dtypes; anything else a file may hold is written in the default
// dtype of its engine tensor (I64 for I16, I8, U64, U32, U16 and BOOL).
bool writer_supports(const std::string& dtype) {
  for (const char* d : {"F32", "F64", "F16", "BF16", "I64", "I32", "U8"})
    if (dtype == d) return true;
  return false;
}

bool same_values(const mn::Tensor& a, const mn::Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  const int64_t n = a.numel();
  if (a.dtype() == mn::DType::f32) {
    const float* x = a.data<float>();
    const float* y = b.data<float>();
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i]) && std::isnan(y[i])) continue;  // half NaNs come back quieted
      if (std::memcmp(&x[i], &y[i], sizeof(float)) != 0) return false;
    }
    return true;
  }
  return std::memcmp(a.data<int64_t>(), b.data<int64_t>(), static_cast<size_t>(n) * sizeof(int64_t)) == 0;
}

void check_round_trip(const st::File& file) {
  st::NamedTensors named;
  st::StringMap dtypes;
  for (const st::Entry& e : file.tensors) {
    if (e.name.empty()) return;  // readable, but the writer refuses empty names by design
    named.emplace_back(e.name, e.tensor);
    if (writer_supports(e.dtype)) dtypes[e.name] = e.dtype;
  }
  // Neither call may throw here: an exception escapes and the fuzzer reports it.
  const std::vector<uint8_t> bytes = st::serialize(named, file.metadata, dtypes);
  const st::File again = st::parse(bytes.data(), bytes.size(), "<round trip>");
  if (again.metadata != file.metadata) round_trip_bug("metadata differs");
  if (again.tensors.size() != file.tensors.size()) round_trip_bug("tensor count differs");
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const st::Entry& before = file.tensors[i];
    const st::Entry& after = again.tensors[i];
    if (after.name != before.name) round_trip_bug("name or order of '" + before.name + "' differs");
    const std::string expected_dtype = writer_supports(before.dtype) ? before.dtype : "I64";
    if (after.dtype != expected_dtype) round_trip_bug("dtype of '" + before.name + "' differs");
    if (!same_values(before.tensor, after.tensor)) round_trip_bug("values of '" + before.name + "' differ");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  st::File file;
  try {
    file = st::parse(data, size, "<fuzz input>");
  } catch (const mn::Error&) {
    return 0;  // rejected cleanly: the expected outcome for most inputs
  }
  check_round_trip(file);
  return 0;
}
