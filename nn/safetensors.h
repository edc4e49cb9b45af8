#pragma once
// safetensors checkpoints (the format tinygrad, PyTorch's safetensors.torch and candle read):
// an 8-byte little-endian header length N, an N-byte JSON header, then one byte buffer that the
// tensors tile exactly. The reader validates everything before it trusts an offset, so a corrupt or
// hostile file ends in an mn::IOError that names the file, the tensor, the offset and what was
// expected, never in a crash or an over-read. The engine only holds f32 and i64 tensors: float
// dtypes are widened or narrowed exactly to f32 where possible, integer and bool dtypes become i64;
// Entry::dtype keeps the dtype the file stored.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mn::safetensors {

struct Entry {
  std::string name;
  Tensor tensor;      // f32 for F32/F64/F16/BF16, i64 for the integer dtypes and BOOL
  std::string dtype;  // the dtype as stored in the file: "F32", "BF16", "BOOL", ...
};

struct File {
  std::vector<Entry> tensors;                   // in header order
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" map

  // The tensor called name; KeyError listing the available names otherwise.
  const Tensor& at(const std::string& name) const;
  const Entry& entry(const std::string& name) const;
  bool contains(const std::string& name) const;
  // Null when absent.
  const Entry* find(const std::string& name) const;
  // The tensors by name: what nn::Module::load_state_dict takes (nn::StateDict is the same type).
  std::map<std::string, Tensor> state_dict() const;
};

// The reader caps the header like the reference implementation does.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Parses a complete safetensors image held in memory. source_name prefixes every error message.
// Reads dtypes F32, F64, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8 and BOOL; anything else is
// an IOError naming the dtype.
File parse(const uint8_t* data, size_t size, const std::string& source_name = "<memory>");

// Reads the whole file and parses it; errors are prefixed with the path.
File load(const std::string& path);

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StringMap = std::map<std::string, std::string>;

// The bytes of a safetensors file holding the tensors in the given order. f32 tensors are written as
// F32 and i64 tensors as I64 unless dtypes names a different output dtype for that tensor: F64, F16
// or BF16 (round to nearest even) for f32 tensors; I32 or U8 for i64 tensors (out-of-range values
// are a ValueError). Names must be non-empty, unique and not "__metadata__". Views and
// non-contiguous tensors are written in row-major order.
std::vector<uint8_t> serialize(const NamedTensors& tensors, const StringMap& metadata = {},
                               const StringMap& dtypes = {});

// Writes `size` bytes to path atomically: into "<path>.tmp.<pid>.<n>" next to path, fsync'd, then renamed
// over path, so a crash or error never leaves a half-written file in place of the old one. Creates
// missing parent directories, and first removes the temporaries of earlier writes to path whose process
// is gone (killed mid-write). On failure the temporary file is removed and IOError thrown.
void write_file_atomically(const std::string& path, const void* data, size_t size);

// serialize() written with write_file_atomically (ValueError for bad arguments, before anything touches
// the disk).
void save(const std::string& path, const NamedTensors& tensors, const StringMap& metadata = {},
          const StringMap& dtypes = {});
// The same for a state dict (nn::Module::state_dict(), an std::map), written in name order. A template
// only so that a braced list, save(path, {{"w", t}}), still means the ordered NamedTensors.
template <class StateDict, class = std::enable_if_t<std::is_same_v<StateDict, std::map<std::string, Tensor>>>>
void save(const std::string& path, const StateDict& state_dict, const StringMap& metadata = {},
          const StringMap& dtypes = {}) {
  save(path, NamedTensors(state_dict.begin(), state_dict.end()), metadata, dtypes);
}

// Exact IEEE half / bfloat16 conversions (core/half.h's, which tensors of dtype f16 / bf16 use too),
// exposed for other readers and writers. A NaN stays a NaN (canonical quiet pattern).
float half_bits_to_float(uint16_t bits);
float bfloat16_bits_to_float(uint16_t bits);
uint16_t float_to_half_bits(float value);      // round to nearest even; overflow gives +-inf
uint16_t float_to_bfloat16_bits(float value);  // round to nearest even; NaN stays NaN

}  // namespace mn::safetensors
