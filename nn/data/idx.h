#pragma once
// Readers for the IDX format of MNIST and Fashion-MNIST, gzip'd or plain (zlib's gzread passes plain
// files through unchanged, so both go through the same code).
//
// Layout: two zero bytes, a type byte, a dimension count, that many big-endian u32 sizes, then the
// values in row-major order. Only unsigned bytes (type 0x08) are supported: that is what every
// (Fashion-)MNIST file holds. Any problem with a file throws mn::IOError naming the file, the byte
// offset (in the decompressed stream), what was expected and what came.
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mn::data {

// Magic numbers of the two files (Fashion-)MNIST ships per split: u8 type, 3 and 1 dimensions.
constexpr uint32_t kIdxImagesMagic = 0x00000803;
constexpr uint32_t kIdxLabelsMagic = 0x00000801;
constexpr uint8_t kIdxTypeU8 = 0x08;
// Files claiming more values than this are refused before anything is allocated for them.
constexpr int64_t kIdxMaxElements = 1'000'000'000;

// The raw contents of a u8 IDX file.
struct IdxArray {
  std::vector<int64_t> dims;   // as stored in the header, outermost first
  std::vector<uint8_t> bytes;  // the values, row-major; size() == numel()
  int64_t numel() const { return static_cast<int64_t>(bytes.size()); }
};

// Any u8 IDX file with at least one dimension.
IdxArray read_idx(const std::string& path);

// Images (magic 0x00000803, dims [N, rows, cols]) as f32 [N, 1, rows, cols] in [0, 1] (bytes / 255).
Tensor read_idx_images(const std::string& path);

// Labels (magic 0x00000801, dims [N]) as i64 [N].
Tensor read_idx_labels(const std::string& path);

}  // namespace mn::data
