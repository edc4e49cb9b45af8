// Data loading: IDX files (plain and gzip'd, written here), Fashion-MNIST, DataLoader.
#include <doctest/doctest.h>

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/data/dataloader.h"
#include "nn/data/fashion_mnist.h"
#include "nn/data/idx.h"
#include "tests/temp_dir.h"
#include "tests/test_support.h"

namespace fs = std::filesystem;
using namespace mn;
using namespace mn::data;
using mn::testing::contains;

namespace {

using mn::testing::TempDir;

using Bytes = std::vector<uint8_t>;

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
void put_be32(Bytes& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}
void put_le32(Bytes& out, uint32_t v) {
  for (int shift = 0; shift <= 24; shift += 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

Bytes idx_file(uint8_t type, const std::vector<uint32_t>& dims, const Bytes& data) {
  Bytes out = {0, 0, type, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) put_be32(out, d);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

uint32_t crc32_of(const Bytes& data) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (uint8_t b : data) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

// A valid gzip member made of stored (uncompressed) deflate blocks: exercises the gzip path of the
// reader without the test needing zlib itself.
Bytes gzip_stored(const Bytes& data) {
  Bytes out = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff};  // magic, deflate, no flags, mtime, xfl, OS unknown
  size_t pos = 0;
  do {
    const size_t len = std::min<size_t>(data.size() - pos, 65535);
    const bool final_block = pos + len == data.size();
    out.push_back(final_block ? 1 : 0);  // BFINAL, BTYPE = 00 (stored)
    out.push_back(static_cast<uint8_t>(len));
    out.push_back(static_cast<uint8_t>(len >> 8));
    out.push_back(static_cast<uint8_t>(~len));
    out.push_back(static_cast<uint8_t>(~len >> 8));
    out.insert(out.end(), data.begin() + static_cast<std::ptrdiff_t>(pos),
               data.begin() + static_cast<std::ptrdiff_t>(pos + len));
    pos += len;
  } while (pos < data.size());
  put_le32(out, crc32_of(data));
  put_le32(out, static_cast<uint32_t>(data.size()));
  return out;
}

// The same member compressed by zlib's deflate (level 9), whose decoder reads ahead of the data it
// delivers: the case where the gzip trailer's absence went unnoticed.
Bytes gzip_deflated(const Bytes& data) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out(deflateBound(&z, static_cast<uLong>(data.size())));
  z.next_in = const_cast<Bytef*>(data.data());
  z.avail_in = static_cast<uInt>(data.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

// Runs f, which must throw E; returns the message.
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("threw the wrong exception type: ", e.what());
    return {};
  }
  FAIL("did not throw");
  return {};
}

// 3 images of 2 x 4 pixels covering 0, 255 and values in between.
Bytes sample_pixels() {
  Bytes px(3 * 2 * 4);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 37) % 256);
  px[0] = 0;
  px[1] = 255;
  return px;
}

void check_sample_images(const Tensor& images) {
  const Bytes px = sample_pixels();
  REQUIRE(images.dtype() == DType::f32);
  REQUIRE(images.sizes() == Shape{3, 1, 2, 4});
  const std::vector<float> got = images.to_vector<float>();
  for (size_t i = 0; i < px.size(); ++i) CHECK(got[i] == static_cast<float>(px[i]) / 255.0f);
  CHECK(got[0] == 0.0f);
  CHECK(got[1] == 1.0f);
}

std::vector<int64_t> sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> iota_vector(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

// Inputs whose sample i is [i, 1000 + i] and targets i, so a batch shows which samples it holds.
struct Numbered {
  Tensor inputs;
  Tensor targets;
};
Numbered numbered(int64_t n) {
  std::vector<float> in;
  std::vector<int64_t> tg;
  for (int64_t i = 0; i < n; ++i) {
    in.push_back(static_cast<float>(i));
    in.push_back(static_cast<float>(1000 + i));
    tg.push_back(i);
  }
  return {from_vector(in, {n, 2}), from_vector(tg, {n})};
}

// The samples an epoch visits, in order, checking each batch's inputs against its targets.
std::vector<int64_t> visit(const DataLoader& loader, std::vector<int64_t>* batch_sizes = nullptr) {
  std::vector<int64_t> seen;
  int64_t expected_index = 0;
  for (const Batch& b : loader) {
    CHECK(b.index == expected_index++);
    const std::vector<int64_t> targets = b.targets.to_vector<int64_t>();
    const std::vector<float> inputs = b.inputs.to_vector<float>();
    REQUIRE(inputs.size() == 2 * targets.size());
    for (size_t k = 0; k < targets.size(); ++k) {
      CHECK(inputs[2 * k] == static_cast<float>(targets[k]));
      CHECK(inputs[2 * k + 1] == static_cast<float>(1000 + targets[k]));
    }
    if (batch_sizes) batch_sizes->push_back(b.inputs.size(0));
    seen.insert(seen.end(), targets.begin(), targets.end());
  }
  return seen;
}

}  // namespace

// ---- IDX reading ---------------------------------------------------------------------------------

TEST_CASE("data: IDX images and labels read back from plain and gzip'd files") {
  TempDir dir("mn_test_data");
  const Bytes images = idx_file(0x08, {3, 2, 4}, sample_pixels());
  const Bytes labels = idx_file(0x08, {3}, {9, 0, 7});
  write_file(dir.file("images.idx"), images);
  write_file(dir.file("images.idx.gz"), gzip_stored(images));
  write_file(dir.file("labels.idx"), labels);
  write_file(dir.file("labels.idx.gz"), gzip_stored(labels));

  for (const char* suffix : {"", ".gz"}) {
    INFO("suffix '" << suffix << "'");
    check_sample_images(read_idx_images(dir.file(std::string("images.idx") + suffix)));
    const Tensor y = read_idx_labels(dir.file(std::string("labels.idx") + suffix));
    REQUIRE(y.dtype() == DType::i64);
    REQUIRE(y.sizes() == Shape{3});
    CHECK(y.to_vector<int64_t>() == std::vector<int64_t>{9, 0, 7});

    const IdxArray raw = read_idx(dir.file(std::string("images.idx") + suffix));
    CHECK(raw.dims == std::vector<int64_t>{3, 2, 4});
    CHECK(raw.bytes == sample_pixels());
  }
}

TEST_CASE("data: read_idx takes any rank, empty arrays and multi-block gzip streams") {
  TempDir dir("mn_test_data");
  Bytes big(70000 * 2);  // more than one 64 KiB stored block
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + i / 256);
  write_file(dir.file("big.gz"), gzip_stored(idx_file(0x08, {70000, 2}, big)));
  const IdxArray raw = read_idx(dir.file("big.gz"));
  CHECK(raw.dims == std::vector<int64_t>{70000, 2});
  CHECK(raw.numel() == 140000);
  CHECK(raw.bytes == big);
  // Its trailer cut off: large reads used to leave zlib's gz layer at the end of its input without
  // having inflated the trailer, and it then reported a clean end.
  // Image-like data: runs of zeros between noisy strokes. 462,000 bytes: the reader's last piece is then
  // large enough (>= 128 KiB) that zlib's gz layer inflated it straight into the caller's buffer, which
  // is what left the trailer unread.
  Bytes images(462000);
  uint32_t lcg = 12345;
  for (size_t i = 0; i < images.size(); ++i) {
    lcg = lcg * 1664525u + 1013904223u;
    images[i] = (i / 28) % 3 == 0 ? static_cast<uint8_t>(lcg >> 24) : 0;
  }
  for (bool deflated : {false, true}) {
    const Bytes big_idx = idx_file(0x08, {15400, 30}, images);
    const Bytes big_gz = deflated ? gzip_deflated(big_idx) : gzip_stored(big_idx);
    write_file(dir.file("big_whole.gz"), big_gz);
    CHECK(read_idx(dir.file("big_whole.gz")).bytes == images);
    for (int cut : {8, 4, 1}) {
      INFO("deflated: " << deflated << ", trailer bytes cut: " << cut);
      write_file(dir.file("big_cut.gz"), Bytes(big_gz.begin(), big_gz.end() - cut));
      CHECK_THROWS_WITH_AS(read_idx(dir.file("big_cut.gz")), doctest::Contains("gzip trailer"), IOError);
    }
  }
  // Two gzip members concatenated are one stream (as gzip -d reads them); bytes after the last member
  // that do not start another are ignored, as zlib does.
  const Bytes whole = idx_file(0x08, {4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  Bytes two = gzip_stored(Bytes(whole.begin(), whole.begin() + 13));
  const Bytes second = gzip_stored(Bytes(whole.begin() + 13, whole.end()));
  two.insert(two.end(), second.begin(), second.end());
  write_file(dir.file("two_members.gz"), two);
  CHECK(read_idx(dir.file("two_members.gz")).bytes == Bytes{1, 2, 3, 4, 5, 6, 7, 8});
  two.insert(two.end(), {0, 0, 0});
  write_file(dir.file("padded.gz"), two);
  CHECK(read_idx(dir.file("padded.gz")).bytes == Bytes{1, 2, 3, 4, 5, 6, 7, 8});

  write_file(dir.file("rank4"), idx_file(0x08, {2, 1, 1, 3}, {1, 2, 3, 4, 5, 6}));
  CHECK(read_idx(dir.file("rank4")).dims == std::vector<int64_t>{2, 1, 1, 3});

  write_file(dir.file("empty_images"), idx_file(0x08, {0, 28, 28}, {}));
  CHECK(read_idx_images(dir.file("empty_images")).sizes() == Shape{0, 1, 28, 28});
  write_file(dir.file("empty_labels.gz"), gzip_stored(idx_file(0x08, {0}, {})));
  CHECK(read_idx_labels(dir.file("empty_labels.gz")).sizes() == Shape{0});
}

TEST_CASE("data: missing file, directory and wrong magic") {
  TempDir dir("mn_test_data");
  const std::string missing = dir.file("nope-images-idx3-ubyte.gz");
  std::string msg = message_of<IOError>([&] { read_idx_images(missing); });
  CHECK(contains(msg, "not found: " + missing));

  msg = message_of<IOError>([&] { read_idx(dir.path().string()); });
  CHECK(contains(msg, dir.path().string()));
  CHECK(contains(msg, "directory"));

  // Labels where images are expected, and the other way round.
  const std::string labels = dir.file("labels.idx");
  write_file(labels, idx_file(0x08, {3}, {1, 2, 3}));
  msg = message_of<IOError>([&] { read_idx_images(labels); });
  CHECK(contains(msg, labels));
  CHECK(contains(msg, "offset 0"));
  CHECK(contains(msg, "expected 0x00000803"));
  CHECK(contains(msg, "got 0x00000801"));

  const std::string images = dir.file("images.idx.gz");
  write_file(images, gzip_stored(idx_file(0x08, {3, 2, 4}, sample_pixels())));
  msg = message_of<IOError>([&] { read_idx_labels(images); });
  CHECK(contains(msg, images));
  CHECK(contains(msg, "expected 0x00000801"));
  CHECK(contains(msg, "got 0x00000803"));

  // Not IDX at all (and not gzip either: gzread passes it through as plain bytes).
  const std::string text = dir.file("readme.txt");
  write_file(text, Bytes{'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'});
  msg = message_of<IOError>([&] { read_idx_images(text); });
  CHECK(contains(msg, text));
  CHECK(contains(msg, "0x68656C6C"));
  msg = message_of<IOError>([&] { read_idx(text); });
  CHECK(contains(msg, "offset 0"));
  CHECK(contains(msg, "two zero bytes"));
}

TEST_CASE("data: unsupported type, absurd dims and trailing bytes") {
  TempDir dir("mn_test_data");
  const std::string floats = dir.file("floats.idx");
  write_file(floats, idx_file(0x0D, {2}, Bytes(8, 0)));
  std::string msg = message_of<IOError>([&] { read_idx(floats); });
  CHECK(contains(msg, floats));
  CHECK(contains(msg, "0x0D (f32)"));
  CHECK(contains(msg, "offset 2"));

  const std::string zero_dims = dir.file("zero_dims.idx");
  write_file(zero_dims, idx_file(0x08, {}, {}));
  msg = message_of<IOError>([&] { read_idx(zero_dims); });
  CHECK(contains(msg, "offset 3"));

  // 2^48 values: refused from the header alone, before any allocation.
  const std::string huge = dir.file("huge.idx");
  write_file(huge, idx_file(0x08, {65536, 65536, 65536}, Bytes(16, 1)));
  msg = message_of<IOError>([&] { read_idx_images(huge); });
  CHECK(contains(msg, huge));
  CHECK(contains(msg, "[65536, 65536, 65536]"));
  // 4 * 2^32-1 would overflow int64 if multiplied naively.
  write_file(huge, idx_file(0x08, {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, {}));
  CHECK_THROWS_AS(read_idx(huge), IOError);
  // Just above the 1e9 limit.
  write_file(huge, idx_file(0x08, {1000000001}, {}));
  CHECK_THROWS_AS(read_idx_labels(huge), IOError);

  // Plausible dims, but a 70-byte gzip file cannot inflate to 10 MB: reported as the truncation it is,
  // without allocating 40 MB for the images first.
  const std::string short_gz = dir.file("short.gz");
  write_file(short_gz, gzip_stored(idx_file(0x08, {1000, 100, 100}, Bytes(16, 1))));
  msg = message_of<IOError>([&] { read_idx_images(short_gz); });
  CHECK(contains(msg, short_gz));
  CHECK(contains(msg, "byte offset 32"));
  CHECK(contains(msg, "expected 10000000 bytes from offset 16, got 16"));

  const std::string longer = dir.file("longer.idx");
  write_file(longer, idx_file(0x08, {3}, {1, 2, 3, 4}));
  msg = message_of<IOError>([&] { read_idx_labels(longer); });
  CHECK(contains(msg, longer));
  CHECK(contains(msg, "offset 11"));
}

TEST_CASE("data: truncated header and data, plain and gzip'd") {
  TempDir dir("mn_test_data");
  const Bytes images = idx_file(0x08, {3, 2, 4}, sample_pixels());  // 16-byte header + 24 data bytes

  for (bool gz : {false, true}) {
    INFO("gzip: " << gz);
    // Cut inside the second dimension: 8 header bytes complete, 2 of the next 4 present.
    const std::string header_cut = dir.file(gz ? "header_cut.gz" : "header_cut");
    write_file(header_cut, gz ? gzip_stored(Bytes(images.begin(), images.begin() + 10))
                              : Bytes(images.begin(), images.begin() + 10));
    std::string msg = message_of<IOError>([&] { read_idx_images(header_cut); });
    CHECK(contains(msg, header_cut));
    CHECK(contains(msg, "byte offset 10"));
    CHECK(contains(msg, "expected 4 bytes from offset 8, got 2"));

    // 20 of 24 data bytes.
    const std::string data_cut = dir.file(gz ? "data_cut.gz" : "data_cut");
    const Bytes data_short(images.begin(), images.end() - 4);
    write_file(data_cut, gz ? gzip_stored(data_short) : data_short);
    msg = message_of<IOError>([&] { read_idx_images(data_cut); });
    CHECK(contains(msg, data_cut));
    CHECK(contains(msg, "byte offset 36"));
    CHECK(contains(msg, "expected 24 bytes from offset 16, got 20"));

    // Empty file.
    const std::string empty_file = dir.file(gz ? "empty.gz" : "empty");
    write_file(empty_file, gz ? gzip_stored({}) : Bytes{});
    msg = message_of<IOError>([&] { read_idx_labels(empty_file); });
    CHECK(contains(msg, "byte offset 0"));
    CHECK(contains(msg, "got 0"));
  }

  // The gzip stream itself cut off in the middle of the data.
  const Bytes gz = gzip_stored(images);
  const std::string stream_cut = dir.file("stream_cut.gz");
  write_file(stream_cut, Bytes(gz.begin(), gz.begin() + 10 + 5 + 30));  // gzip header, block header, 30 bytes
  std::string msg = message_of<IOError>([&] { read_idx_images(stream_cut); });
  CHECK(contains(msg, stream_cut));
  CHECK(contains(msg, "byte offset 30"));
  CHECK(contains(msg, "expected 24 bytes from offset 16, got 14"));
  CHECK(contains(msg, "gzip"));

  // All data present but the gzip trailer (CRC-32 then length, 4 bytes each) missing or cut short: the
  // length alone missing (4 bytes cut) was accepted before.
  for (int cut : {8, 5, 4, 1}) {
    INFO("trailer bytes cut: " << cut);
    const std::string no_trailer = dir.file(str("no_trailer_", cut, ".gz"));
    write_file(no_trailer, Bytes(gz.begin(), gz.end() - cut));
    msg = message_of<IOError>([&] { read_idx_images(no_trailer); });
    CHECK(contains(msg, no_trailer));
    CHECK(contains(msg, "trailer"));
  }
}

TEST_CASE("data: corrupt gzip streams report zlib's error and an offset") {
  TempDir dir("mn_test_data");
  const Bytes images = idx_file(0x08, {3, 2, 4}, sample_pixels());

  // A gzip header followed by garbage: the block type bits say 11, which deflate does not have.
  const std::string garbage = dir.file("garbage.gz");
  write_file(garbage, Bytes{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0x07, 0xde, 0xad, 0xbe, 0xef, 0x00, 0x11});
  std::string msg = message_of<IOError>([&] { read_idx_images(garbage); });
  CHECK(contains(msg, garbage));
  CHECK(contains(msg, "corrupt gzip stream"));
  CHECK(contains(msg, "invalid block type"));
  CHECK(contains(msg, "compressed byte offset 11"));  // the block header right after the 10-byte gzip header

  // An unknown compression method in the gzip header.
  const std::string bad_method = dir.file("bad_method.gz");
  Bytes method = gzip_stored(images);
  method[2] = 7;
  write_file(bad_method, method);
  msg = message_of<IOError>([&] { read_idx_images(bad_method); });
  CHECK(contains(msg, bad_method));
  CHECK(contains(msg, "corrupt gzip stream"));

  // A flipped data byte inflates fine, but the CRC in the trailer no longer matches.
  const std::string bad_crc = dir.file("bad_crc.gz");
  Bytes flipped = gzip_stored(images);
  flipped[10 + 5 + 20] ^= 0x40;
  write_file(bad_crc, flipped);
  msg = message_of<IOError>([&] { read_idx_images(bad_crc); });
  CHECK(contains(msg, bad_crc));
  CHECK(contains(msg, "incorrect data check"));
  CHECK(contains(msg, "compressed byte offset 59"));  // the CRC ends 4 bytes before the 63-byte file does
}

// ---- Fashion-MNIST ------------------------------------------------------------------------------

TEST_CASE("data: load_fashion_mnist from a synthetic root") {
  TempDir dir("mn_test_data");
  write_file(dir.file("train-images-idx3-ubyte.gz"), gzip_stored(idx_file(0x08, {3, 2, 4}, sample_pixels())));
  write_file(dir.file("train-labels-idx1-ubyte.gz"), gzip_stored(idx_file(0x08, {3}, {9, 0, 7})));
  // The test split unpacked (no .gz), with one label too few.
  write_file(dir.file("t10k-images-idx3-ubyte"), idx_file(0x08, {3, 2, 4}, sample_pixels()));
  write_file(dir.file("t10k-labels-idx1-ubyte"), idx_file(0x08, {2}, {1, 2}));

  const Dataset train = load_fashion_mnist("train", dir.path().string());
  CHECK(train.size() == 3);
  check_sample_images(train.images);
  CHECK(train.labels.to_vector<int64_t>() == std::vector<int64_t>{9, 0, 7});

  std::string msg = message_of<IOError>([&] { load_fashion_mnist("test", dir.path().string()); });
  CHECK(contains(msg, dir.file("t10k-images-idx3-ubyte")));
  CHECK(contains(msg, dir.file("t10k-labels-idx1-ubyte")));
  CHECK(contains(msg, "3 images"));
  CHECK(contains(msg, "2 labels"));

  // A label outside 0..9.
  write_file(dir.file("t10k-labels-idx1-ubyte"), idx_file(0x08, {3}, {1, 10, 2}));
  msg = message_of<IOError>([&] { load_fashion_mnist("test", dir.path().string()); });
  CHECK(contains(msg, dir.file("t10k-labels-idx1-ubyte")));
  CHECK(contains(msg, "byte offset 9"));

  msg = message_of<ValueError>([&] { load_fashion_mnist("validation", dir.path().string()); });
  CHECK(contains(msg, "validation"));

  const TempDir empty_dir("mn_test_data");
  msg = message_of<IOError>([&] { load_fashion_mnist("train", empty_dir.path().string()); });
  CHECK(contains(msg, "not found: " + empty_dir.file("train-images-idx3-ubyte.gz")));
}

TEST_CASE("data: Fashion-MNIST root, classes and normalize") {
  const char* old = std::getenv("MN_FASHION_MNIST_DIR");
  const std::string saved = old ? old : "";
  ::setenv("MN_FASHION_MNIST_DIR", "/somewhere/else", 1);
  CHECK(default_fashion_mnist_root() == "/somewhere/else");
  ::unsetenv("MN_FASHION_MNIST_DIR");
  CHECK(default_fashion_mnist_root() == "/usr/share/datasets/fashion-mnist");
  if (old) ::setenv("MN_FASHION_MNIST_DIR", saved.c_str(), 1);

  const std::vector<std::string> classes = fashion_mnist_classes();
  REQUIRE(classes.size() == 10);
  CHECK(classes[0] == "T-shirt/top");
  CHECK(classes[9] == "Ankle boot");

  const Tensor x = from_vector(std::vector<float>{0.0f, 0.2860f, 1.0f}, {3});
  const std::vector<float> y = normalize(x).to_vector<float>();
  CHECK(y[0] == doctest::Approx(-0.2860 / 0.3530).epsilon(1e-6));
  CHECK(y[1] == doctest::Approx(0.0).epsilon(1e-6));
  CHECK(y[2] == doctest::Approx((1.0 - 0.2860) / 0.3530).epsilon(1e-6));
  CHECK_THROWS_AS(normalize(x, 0.5, 0.0), ValueError);
}

TEST_CASE("data: the real Fashion-MNIST test split") {
  const std::string root = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(fs::path(root) / "t10k-images-idx3-ubyte.gz")) {
    MESSAGE("skipped: Fashion-MNIST is not installed under " << root << " (apt-get install dataset-fashion-mnist)");
    return;
  }
  const Dataset test = load_fashion_mnist("test", root);
  REQUIRE(test.images.sizes() == Shape{10000, 1, 28, 28});
  REQUIRE(test.labels.sizes() == Shape{10000});
  CHECK(test.size() == 10000);
  const std::vector<float> px = test.images.to_vector<float>();
  const auto [lo, hi] = std::minmax_element(px.begin(), px.end());
  CHECK(*lo == 0.0f);
  CHECK(*hi == 1.0f);
  const std::vector<int64_t> labels = test.labels.to_vector<int64_t>();
  CHECK(labels[0] == 9);  // Ankle boot
  CHECK(fashion_mnist_classes()[static_cast<size_t>(labels[0])] == "Ankle boot");
  std::vector<int64_t> per_class(10, 0);
  for (int64_t l : labels) {
    REQUIRE(l >= 0);
    REQUIRE(l <= 9);
    ++per_class[static_cast<size_t>(l)];
  }
  for (int64_t count : per_class) CHECK(count == 1000);  // the test split is balanced
}

// ---- shuffling and DataLoader -------------------------------------------------------------------

TEST_CASE("data: shuffled_indices is a pure, seeded permutation") {
  for (int64_t n : {0, 1, 2, 7, 1000}) {
    const std::vector<int64_t> p = shuffled_indices(n, 42, 3);
    CHECK(sorted(p) == iota_vector(n));
    CHECK(shuffled_indices(n, 42, 3) == p);
  }
  const std::vector<int64_t> base = shuffled_indices(1000, 42, 0);
  CHECK(base != iota_vector(1000));
  CHECK(shuffled_indices(1000, 42, 1) != base);
  CHECK(shuffled_indices(1000, 43, 0) != base);
  // Pinned values: the order must not change between builds, machines or library versions, or
  // resumed and distributed runs would disagree with earlier ones.
  CHECK(shuffled_indices(10, 42, 0) == std::vector<int64_t>{5, 4, 8, 7, 6, 3, 2, 0, 9, 1});
  CHECK(shuffled_indices(10, 0, 7) == std::vector<int64_t>{0, 9, 5, 4, 3, 7, 1, 8, 6, 2});
  CHECK_THROWS_AS(shuffled_indices(-1, 0, 0), ValueError);

  // Each position should get each element about equally often over many epochs.
  const int64_t n = 5;
  const int epochs = 20000;
  std::vector<int> first(n, 0);
  for (int e = 0; e < epochs; ++e) ++first[static_cast<size_t>(shuffled_indices(n, 9, static_cast<uint64_t>(e))[0])];
  for (int count : first) CHECK(std::abs(count - epochs / n) < 300);  // ~5 standard deviations
}

TEST_CASE("data: DataLoader batch counts, partial batch and order without shuffling") {
  const Numbered d = numbered(10);

  DataLoader keep(d.inputs, d.targets, {.batch_size = 4});
  CHECK(keep.size() == 3);
  CHECK(keep.num_samples() == 10);
  std::vector<int64_t> sizes;
  CHECK(visit(keep, &sizes) == iota_vector(10));  // identity order
  CHECK(sizes == std::vector<int64_t>{4, 4, 2});
  const Batch last = keep.batch(2);
  CHECK(last.inputs.sizes() == Shape{2, 2});
  CHECK(last.targets.to_vector<int64_t>() == std::vector<int64_t>{8, 9});
  CHECK(last.index == 2);
  CHECK(last.inputs.is_contiguous());
  CHECK_THROWS_AS(keep.batch(3), IndexError);

  DataLoader drop(d.inputs, d.targets, {.batch_size = 4, .drop_last = true});
  CHECK(drop.size() == 2);
  sizes.clear();
  CHECK(visit(drop, &sizes) == iota_vector(8));
  CHECK(sizes == std::vector<int64_t>{4, 4});

  // Exact multiples, batch larger than the data, and no data at all.
  CHECK(DataLoader(d.inputs, d.targets, {.batch_size = 5}).size() == 2);
  CHECK(DataLoader(d.inputs, d.targets, {.batch_size = 5, .drop_last = true}).size() == 2);
  CHECK(DataLoader(d.inputs, d.targets, {.batch_size = 64}).size() == 1);
  CHECK(DataLoader(d.inputs, d.targets, {.batch_size = 64, .drop_last = true}).size() == 0);
  // A batch size near INT64_MAX: rounding up used to overflow into no batches at all.
  DataLoader huge(d.inputs, d.targets, {.batch_size = INT64_MAX});
  REQUIRE(huge.size() == 1);
  CHECK(huge.batch(0).inputs.size(0) == d.inputs.size(0));
  CHECK(DataLoader(d.inputs, d.targets, {.batch_size = INT64_MAX, .drop_last = true}).size() == 0);
  const Numbered none = numbered(0);
  DataLoader empty_loader(none.inputs, none.targets, {.batch_size = 3, .shuffle = true});
  CHECK(empty_loader.size() == 0);
  CHECK(empty_loader.begin() == empty_loader.end());

  // Batches own their memory: writing into one leaves the data set alone.
  Batch b = keep.batch(0);
  b.inputs.fill_(-1.0);
  CHECK(d.inputs.to_vector<float>()[0] == 0.0f);

  // shuffle = false ignores the epoch.
  keep.set_epoch(5);
  CHECK(visit(keep) == iota_vector(10));
}

TEST_CASE("data: DataLoader shuffling visits every sample once, reproducibly per (seed, epoch)") {
  const Numbered d = numbered(103);
  const DataLoaderOptions options{.batch_size = 10, .shuffle = true, .seed = 1234};
  DataLoader loader(d.inputs, d.targets, options);
  CHECK(loader.size() == 11);

  const std::vector<int64_t> epoch0 = visit(loader);
  CHECK(sorted(epoch0) == iota_vector(103));
  CHECK(epoch0 != iota_vector(103));
  CHECK(epoch0 == shuffled_indices(103, 1234, 0));
  CHECK(loader.order().to_vector<int64_t>() == epoch0);
  CHECK(visit(loader) == epoch0);  // iterating again without set_epoch repeats the order

  loader.set_epoch(1);
  const std::vector<int64_t> epoch1 = visit(loader);
  CHECK(sorted(epoch1) == iota_vector(103));
  CHECK(epoch1 != epoch0);
  CHECK(loader.epoch() == 1);

  // A second loader (a rerun) with the same seed and epoch sees the same order.
  DataLoader again(d.inputs, d.targets, options);
  again.set_epoch(1);
  CHECK(visit(again) == epoch1);
  again.set_epoch(0);
  CHECK(visit(again) == epoch0);

  // drop_last with shuffling drops the tail of the shuffled order.
  DataLoader dropping(d.inputs, d.targets, {.batch_size = 10, .shuffle = true, .seed = 1234, .drop_last = true});
  CHECK(dropping.size() == 10);
  CHECK(visit(dropping) == std::vector<int64_t>(epoch0.begin(), epoch0.begin() + 100));

  DataLoader other_seed(d.inputs, d.targets, {.batch_size = 10, .shuffle = true, .seed = 4321});
  CHECK(visit(other_seed) != epoch0);
}

namespace {

// Visits the odd samples, in reverse on odd epochs (or, for the error checks, whatever it is told).
class OddSampler : public Sampler {
 public:
  explicit OddSampler(int64_t n) : n_(n) {}
  int64_t num_samples() const override { return n_; }
  int64_t size() const override { return n_ / 2; }
  void set_epoch(uint64_t epoch) override { epoch_ = epoch; }
  uint64_t epoch() const override { return epoch_; }
  std::vector<int64_t> indices() const override {
    if (override_) return *override_;
    std::vector<int64_t> odd;
    for (int64_t i = 1; i < n_; i += 2) odd.push_back(i);
    if (epoch_ % 2 == 1) std::reverse(odd.begin(), odd.end());
    return odd;
  }
  std::optional<std::vector<int64_t>> override_;

 private:
  int64_t n_;
  uint64_t epoch_ = 0;
};

}  // namespace

TEST_CASE("data: DataLoader with a sampler visits its indices and follows its epoch") {
  const Numbered d = numbered(10);
  auto sampler = std::make_shared<OddSampler>(10);
  DataLoader loader(d.inputs, d.targets, {.batch_size = 2, .sampler = sampler});
  CHECK(loader.size() == 3);  // 5 samples
  std::vector<int64_t> sizes;
  CHECK(visit(loader, &sizes) == std::vector<int64_t>{1, 3, 5, 7, 9});
  CHECK(sizes == std::vector<int64_t>{2, 2, 1});
  CHECK(loader.order().to_vector<int64_t>() == std::vector<int64_t>{1, 3, 5, 7, 9});
  CHECK(loader.num_samples() == 10);

  // An epoch set on the sampler itself is seen by the next iteration, as with PyTorch's
  // sampler.set_epoch; the loader's set_epoch forwards to the sampler; copies share it.
  sampler->set_epoch(1);
  CHECK(loader.epoch() == 1);
  CHECK(visit(loader) == std::vector<int64_t>{9, 7, 5, 3, 1});
  CHECK(loader.batch(2).targets.to_vector<int64_t>() == std::vector<int64_t>{1});
  loader.set_epoch(2);
  CHECK(sampler->epoch() == 2);
  const DataLoader copy = loader;
  sampler->set_epoch(3);
  CHECK(visit(copy) == std::vector<int64_t>{9, 7, 5, 3, 1});
  CHECK(visit(loader) == std::vector<int64_t>{9, 7, 5, 3, 1});

  DataLoader dropping(d.inputs, d.targets, {.batch_size = 2, .drop_last = true, .sampler = sampler});
  CHECK(dropping.size() == 2);
  CHECK(visit(dropping) == std::vector<int64_t>{9, 7, 5, 3});

  // Refusals: shuffling as well, a sampler of another data set, indices it should not give.
  std::string msg = message_of<ValueError>(
      [&] { DataLoader(d.inputs, d.targets, {.batch_size = 2, .shuffle = true, .sampler = sampler}); });
  CHECK(contains(msg, "shuffle must be false"));
  msg = message_of<ValueError>(
      [&] { DataLoader(d.inputs, d.targets, {.batch_size = 2, .sampler = std::make_shared<OddSampler>(12)}); });
  CHECK(contains(msg, "the sampler indexes 12 samples but the data set holds 10"));
  auto bad = std::make_shared<OddSampler>(10);
  DataLoader checked(d.inputs, d.targets, {.batch_size = 2, .sampler = bad});
  bad->override_ = std::vector<int64_t>{1, 3, 5, 7, 10};
  bad->set_epoch(1);
  msg = message_of<IndexError>([&] { (void)checked.begin(); });
  CHECK(contains(msg, "the sampler gave index 10, outside the data set's 10 samples"));
  bad->override_ = std::vector<int64_t>{1, 3};
  bad->set_epoch(2);
  msg = message_of<ValueError>([&] { (void)checked.order(); });
  CHECK(contains(msg, "the sampler gave 2 indices for an epoch of size() 5"));
}

TEST_CASE("data: DataLoader argument checks and the Dataset overload") {
  const Numbered d = numbered(6);
  std::string msg = message_of<ValueError>([&] { DataLoader(d.inputs, d.targets, {.batch_size = 0}); });
  CHECK(contains(msg, "batch_size"));
  CHECK_THROWS_AS(DataLoader(d.inputs, d.targets, {.batch_size = -3}), ValueError);
  msg = message_of<ValueError>([&] { DataLoader(d.inputs, d.targets.narrow(0, 0, 5), {.batch_size = 2}); });
  CHECK(contains(msg, "6"));
  CHECK(contains(msg, "5"));
  CHECK_THROWS_AS(DataLoader(d.inputs, Tensor(), {.batch_size = 2}), ValueError);
  CHECK_THROWS_AS(DataLoader(d.inputs, scalar_tensor(1.0), {.batch_size = 2}), ValueError);

  Dataset ds;
  ds.images = zeros({5, 1, 2, 2});
  ds.labels = from_vector(std::vector<int64_t>{0, 1, 2, 3, 4}, {5});
  DataLoader loader(ds, {.batch_size = 2, .shuffle = true, .seed = 7});
  int64_t samples = 0;
  for (const Batch& b : loader) {
    CHECK(b.inputs.sizes()[1] == 1);
    CHECK(b.inputs.sizes()[2] == 2);
    samples += b.targets.size(0);
  }
  CHECK(samples == 5);
}
