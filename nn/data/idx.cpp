// IDX reading through zlib's inflate(). Offsets in messages count bytes of the decompressed stream (for a
// plain file the two are the same), except for a corrupt gzip stream, which is located by the compressed
// offset where zlib found the damage.
#include "nn/data/idx.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string_view>
#include <system_error>
#include <vector>

namespace mn::data {
namespace {

std::string hex(uint32_t value, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%0*X", digits, value);
  return buf;
}

const char* idx_type_name(uint8_t code) {
  switch (code) {
    case 0x08: return "u8";
    case 0x09: return "i8";
    case 0x0B: return "i16";
    case 0x0C: return "i32";
    case 0x0D: return "f32";
    case 0x0E: return "f64";
    default: return "not an IDX type";
  }
}

// "0x00000803 (u8, 3 dimensions)" — what a magic number means, so a mix-up of the images and labels
// files reads as such in the message rather than as two hex numbers.
std::string describe_magic(uint32_t magic) {
  if ((magic >> 16) != 0) return hex(magic, 8) + " (not an IDX file: its first two bytes must be zero)";
  const uint8_t type = static_cast<uint8_t>(magic >> 8);
  const unsigned ndim = magic & 0xFFu;
  return str(hex(magic, 8), " (", idx_type_name(type), ", ", ndim, ndim == 1 ? " dimension)" : " dimensions)");
}

std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// A plain or gzip'd file read through zlib's inflate() directly, that knows its path and position and
// turns every short read or zlib error into an IOError saying where it happened. Not zlib's gz* layer:
// once a large read had consumed the file's last input bytes, gzread reported a clean end without
// running inflate() on what was left, so a file whose gzip trailer (CRC-32, length) was cut off was
// accepted. Here the end of the data is the end of a gzip member that inflate() itself reported
// (Z_STREAM_END: trailer present and matching). Concatenated members are read as one stream, and bytes
// after the last member that do not start another one are ignored, as gzip and zlib do.
class IdxStream {
 public:
  explicit IdxStream(const std::string& path) : path_(path) {
    std::error_code ec;
    const auto status = std::filesystem::status(path, ec);
    if (status.type() == std::filesystem::file_type::not_found) throw IOError(str("IDX file not found: ", path));
    if (ec) throw IOError(str("cannot access IDX file ", path, ": ", ec.message()));
    if (std::filesystem::is_directory(status))
      throw IOError(str("IDX file expected, but ", path, " is a directory"));
    file_ = std::fopen(path.c_str(), "rb");
    if (file_ == nullptr) throw IOError(str("cannot open IDX file ", path, ": ", std::strerror(errno)));
    file_size_ = std::filesystem::file_size(path, ec);
    if (ec) file_size_ = UINT64_MAX;  // unknown: assume the file can hold anything
    input_.resize(kChunkBytes / 4);
    fill_input();
    gzip_ = available_ >= 2 && input_[0] == 0x1f && input_[1] == 0x8b;
    if (gzip_) {
      if (inflateInit2(&z_, 16 + MAX_WBITS) != Z_OK)  // 16: a gzip wrapper only
        throw IOError(str("cannot read IDX file ", path, ": zlib could not allocate its state"));
      inflating_ = true;
    }
  }
  ~IdxStream() {
    if (inflating_) inflateEnd(&z_);
    std::fclose(file_);
  }
  IdxStream(const IdxStream&) = delete;
  IdxStream& operator=(const IdxStream&) = delete;

  // Size of the pieces the data is read in: fits in L2 next to what it is converted into.
  static constexpr size_t kChunkBytes = size_t{1} << 18;

  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  uint64_t file_size() const { return file_size_; }

  // Whether the file could hold `bytes` more decompressed bytes: exactly for a plain file, and by
  // deflate's best compression ratio (1032:1) with room to spare for gzip.
  bool could_hold(uint64_t bytes) const {
    if (file_size_ == UINT64_MAX) return true;
    if (!gzip_) return offset_ + bytes <= file_size_;
    return offset_ + bytes <= (file_size_ + 1024) * 1100;
  }

  // Reads exactly n bytes or throws; `what` names the field for the message.
  void read_exact(void* dst, size_t n, const std::string& what) {
    const uint64_t start = offset_;
    const size_t got = read_some(dst, n, what);
    if (got < n) throw_truncated(start, n, what);
  }

  // Reads up to n bytes; returns fewer only at the end of the data. Corrupt streams throw.
  size_t read_some(void* dst, size_t n, const std::string& what) {
    auto* out = static_cast<uint8_t*>(dst);
    const size_t got = gzip_ ? inflate_some(out, n, what) : copy_some(out, n);
    offset_ += got;
    return got;
  }

  // The data ended before `expected` bytes starting at `start` could be read.
  [[noreturn]] void throw_truncated(uint64_t start, uint64_t expected, const std::string& what) {
    const std::string cause = cut_off_ ? " (the gzip stream is cut off: the file ends inside it)" : "";
    throw IOError(str("IDX file ", path_, ": truncated: data ends at byte offset ", offset_, " while reading ", what,
                      ": expected ", expected, " bytes from offset ", start, ", got ", offset_ - start, cause));
  }

  // After the last expected byte: the stream must end here, and a gzip stream with its trailer, whose
  // CRC-32 and length inflate() checks against the data.
  void expect_end(const std::string& layout) {
    uint8_t extra;
    const size_t got = read_some(&extra, 1, "the end of the file");
    if (got != 0)
      throw IOError(str("IDX file ", path_, ": unexpected data at byte offset ", offset_ - 1,
                        ": expected the file to end there (", layout, "), but it continues"));
    if (cut_off_)
      throw IOError(str("IDX file ", path_, ": gzip stream truncated after byte offset ", offset_,
                        ": all data was read but the gzip trailer (CRC-32, length) is missing or incomplete"));
  }

 private:
  // Reads more of the file after the unconsumed input; false at the end of the file.
  bool fill_input() {
    if (eof_) return false;
    if (available_ > 0 && consumed_ > 0) std::memmove(input_.data(), input_.data() + consumed_, available_);
    consumed_ = 0;
    const size_t r = std::fread(input_.data() + available_, 1, input_.size() - available_, file_);
    if (r == 0 && std::ferror(file_))
      throw IOError(str("IDX file ", path_, ": read error at compressed byte offset ", file_offset_ + available_,
                        ": ", std::strerror(errno)));
    if (r < input_.size() - available_) eof_ = true;
    available_ += r;
    return r > 0;
  }

  size_t copy_some(uint8_t* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      if (available_ == 0 && !fill_input()) break;
      const size_t k = std::min(n - got, available_);
      std::memcpy(out + got, input_.data() + consumed_, k);
      consume(k);
      got += k;
    }
    return got;
  }

  void consume(size_t k) {
    consumed_ += k;
    available_ -= k;
    file_offset_ += k;
  }

  size_t inflate_some(uint8_t* out, size_t n, const std::string& what) {
    size_t got = 0;
    while (got < n && !finished_) {
      if (member_done_) {
        // Another member follows only if the next bytes are a gzip header.
        if (available_ < 2) fill_input();
        if (available_ < 2 || input_[consumed_] != 0x1f || input_[consumed_ + 1] != 0x8b) {
          finished_ = true;
          break;
        }
        inflateReset(&z_);
        member_done_ = false;
      }
      if (available_ == 0 && !fill_input()) {
        cut_off_ = true;  // the member has not ended, and the file has
        finished_ = true;
        break;
      }
      z_.next_in = input_.data() + consumed_;
      z_.avail_in = static_cast<uInt>(available_);
      const size_t want = std::min<size_t>(n - got, size_t{1} << 30);
      z_.next_out = out + got;
      z_.avail_out = static_cast<uInt>(want);
      const int ret = inflate(&z_, Z_NO_FLUSH);
      got += want - z_.avail_out;
      consume(available_ - z_.avail_in);
      if (ret == Z_STREAM_END) {
        member_done_ = true;
      } else if (ret == Z_BUF_ERROR) {
        // No progress with input left is impossible; without input, read more (or find the file's end).
        if (available_ == 0 && !fill_input()) {
          cut_off_ = true;
          finished_ = true;
        }
      } else if (ret != Z_OK) {
        throw_zlib_error(ret, what);
      }
    }
    return got;
  }

  [[noreturn]] void throw_zlib_error(int ret, const std::string& what) {
    const std::string detail = z_.msg != nullptr ? z_.msg : zError(ret);
    const bool checksum = detail == "incorrect data check" || detail == "incorrect length check";
    // Located in the compressed file: inflate() has consumed everything up to where it found the damage.
    throw IOError(str("IDX file ", path_, ": corrupt gzip stream at compressed byte offset ", file_offset_,
                      " (zlib error ", ret, ": ", detail, ")",
                      checksum ? ": the gzip trailer's CRC-32/length does not match the decompressed data" : "",
                      "; found while reading ", what, " with ", offset_, " decompressed bytes read"));
  }

  std::string path_;
  std::FILE* file_ = nullptr;
  uint64_t file_size_ = UINT64_MAX;
  std::vector<uint8_t> input_;  // read-ahead of the file: input_[consumed_, consumed_ + available_)
  size_t consumed_ = 0, available_ = 0;
  uint64_t file_offset_ = 0;    // file bytes consumed (by inflate, or copied out of a plain file)
  bool eof_ = false;
  bool gzip_ = false, inflating_ = false;
  z_stream z_{};
  bool member_done_ = false;  // inflate() reported Z_STREAM_END for the current member
  bool finished_ = false;     // no more data: the last member ended, or the file did (cut_off_)
  bool cut_off_ = false;      // the file ended inside a gzip member
  uint64_t offset_ = 0;       // decompressed bytes delivered so far
};

uint32_t big_endian_u32(const uint8_t b[4]) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

struct ExpectedMagic {
  uint32_t magic;
  const char* meaning;
};

struct IdxHeader {
  std::vector<int64_t> dims;
  uint64_t numel = 0;
  uint64_t data_offset = 0;  // == header size
  std::string layout;        // "dims [...]: H header bytes + N data bytes", for messages
};

IdxHeader read_header(IdxStream& in, const ExpectedMagic* expected) {
  const std::string& path = in.path();
  uint8_t magic_bytes[4];
  in.read_exact(magic_bytes, 4, "the magic number");
  const uint32_t magic = big_endian_u32(magic_bytes);
  if (expected != nullptr && magic != expected->magic)
    throw IOError(str("IDX file ", path, ": wrong magic number at byte offset 0: expected ", hex(expected->magic, 8),
                      " (", expected->meaning, "), got ", describe_magic(magic)));
  if (magic_bytes[0] != 0 || magic_bytes[1] != 0)
    throw IOError(str("IDX file ", path, ": not an IDX file: expected two zero bytes at byte offset 0, got ",
                      hex(magic_bytes[0], 2), " ", hex(magic_bytes[1], 2)));
  const uint8_t type = magic_bytes[2];
  if (type != kIdxTypeU8)
    throw IOError(str("IDX file ", path, ": unsupported value type ", hex(type, 2), " (", idx_type_name(type),
                      ") at byte offset 2: expected ", hex(kIdxTypeU8, 2), " (u8)"));
  const int ndim = magic_bytes[3];
  if (ndim == 0)
    throw IOError(str("IDX file ", path, ": expected at least one dimension at byte offset 3, got 0"));

  IdxHeader header;
  header.dims.resize(static_cast<size_t>(ndim));
  bool any_zero = false;
  bool too_many = false;
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    uint8_t size_bytes[4];
    in.read_exact(size_bytes, 4, str("the size of dimension ", d, " of ", ndim, " (big-endian u32)"));
    const int64_t size = big_endian_u32(size_bytes);
    header.dims[static_cast<size_t>(d)] = size;
    if (size == 0) any_zero = true;
    // Checked before multiplying, so the product never overflows.
    else if (too_many || numel > kIdxMaxElements / size) too_many = true;
    else numel *= size;
  }
  if (any_zero) numel = 0;
  else if (too_many)
    throw IOError(str("IDX file ", path, ": absurd dims ", dims_str(header.dims), " in the header (byte offset 4): ",
                      "more than ", kIdxMaxElements, " values (at most ", kIdxMaxElements, " are accepted)"));
  header.numel = static_cast<uint64_t>(numel);
  header.data_offset = in.offset();
  header.layout =
      str("dims ", dims_str(header.dims), ": ", header.data_offset, " header bytes + ", numel, " data bytes");
  return header;
}

// Passes the data block to sink(bytes, count, index of bytes[0]) in cache-sized pieces, so that it is
// never held in memory twice, then checks that the file ends right after it.
template <class Sink>
void stream_data(IdxStream& in, const IdxHeader& header, Sink&& sink) {
  const std::string what = str("the data (", header.layout, ")");
  std::vector<uint8_t> chunk(static_cast<size_t>(std::min<uint64_t>(header.numel, IdxStream::kChunkBytes)));
  uint64_t done = 0;
  while (done < header.numel) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(header.numel - done, chunk.size()));
    // Truncation is reported against the whole data block, not this piece of it.
    if (in.read_some(chunk.data(), n, what) < n) in.throw_truncated(header.data_offset, header.numel, what);
    sink(chunk.data(), n, done);
    done += n;
  }
  in.expect_end(header.layout);
}

// Before allocating an output sized by the header: when the file cannot hold that much data, read it
// through to find where its data really ends and report that, rather than allocating for the claim.
void refuse_impossible_sizes(IdxStream& in, const IdxHeader& header) {
  if (in.could_hold(header.numel)) return;
  stream_data(in, header, [](const uint8_t*, size_t, uint64_t) {});  // throws: the data is too short
  throw IOError(str("IDX file ", in.path(), ": ", header.layout, " decompressed from only ", in.file_size(),
                    " bytes, more than deflate can produce; refusing the file"));
}

}  // namespace

IdxArray read_idx(const std::string& path) {
  IdxStream in(path);
  const IdxHeader header = read_header(in, nullptr);
  IdxArray array;
  array.dims = header.dims;
  // Reserving only what the file can hold keeps a short file with huge dims from allocating for them.
  if (in.could_hold(header.numel)) array.bytes.reserve(static_cast<size_t>(header.numel));
  stream_data(in, header, [&](const uint8_t* bytes, size_t n, uint64_t) {
    array.bytes.insert(array.bytes.end(), bytes, bytes + n);
  });
  return array;
}

Tensor read_idx_images(const std::string& path) {
  IdxStream in(path);
  const ExpectedMagic expected{kIdxImagesMagic, "u8 images, 3 dimensions"};
  const IdxHeader header = read_header(in, &expected);
  refuse_impossible_sizes(in, header);
  Tensor images = empty({header.dims[0], 1, header.dims[1], header.dims[2]}, DType::f32);
  float* out = images.data<float>();
  stream_data(in, header, [out](const uint8_t* bytes, size_t n, uint64_t at) {
    float* dst = out + at;
    // A true division (not a multiply by 1/255) so that every value is the correctly rounded b / 255;
    // it vectorises, and the conversion stays well below the cost of inflating.
    for (size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(bytes[i]) / 255.0f;
  });
  return images;
}

Tensor read_idx_labels(const std::string& path) {
  IdxStream in(path);
  const ExpectedMagic expected{kIdxLabelsMagic, "u8 labels, 1 dimension"};
  const IdxHeader header = read_header(in, &expected);
  refuse_impossible_sizes(in, header);
  Tensor labels = empty({header.dims[0]}, DType::i64);
  int64_t* out = labels.data<int64_t>();
  stream_data(in, header, [out](const uint8_t* bytes, size_t n, uint64_t at) {
    for (size_t i = 0; i < n; ++i) out[at + i] = bytes[i];
  });
  return labels;
}

}  // namespace mn::data
