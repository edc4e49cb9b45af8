// safetensors reader and writer, in the byte format of huggingface/safetensors: an 8-byte little-endian
// header length, a JSON header mapping each tensor name to its dtype, shape and data_offsets (plus an
// optional "__metadata__" map of strings), then the tensors' little-endian bytes back to back.
// The reader trusts nothing in the file: every length, offset and shape product is checked, with
// overflow-safe arithmetic, before a byte of the buffer is touched.
#include "nn/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <csignal>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

namespace mn::safetensors {
namespace {

using json = nlohmann::json;

constexpr size_t kLengthFieldBytes = 8;
// A valid header nests three levels deep (root -> entry -> shape); the cap stops hostile nesting
// before the JSON parser grows its stacks with it.
constexpr size_t kMaxHeaderDepth = 16;
constexpr const char* kMetadataKey = "__metadata__";

// ---------------------------------------------------------------------------------------------
// Stored dtypes

enum class Stored : uint8_t { F32, F64, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, BOOL };

struct StoredType {
  Stored id;
  const char* name;
  size_t bytes;
  DType engine_dtype;  // what the reader turns it into
};

constexpr StoredType kStoredTypes[] = {
    {Stored::F32, "F32", 4, DType::f32},  {Stored::F64, "F64", 8, DType::f32},
    {Stored::F16, "F16", 2, DType::f32},  {Stored::BF16, "BF16", 2, DType::f32},
    {Stored::I64, "I64", 8, DType::i64},  {Stored::I32, "I32", 4, DType::i64},
    {Stored::I16, "I16", 2, DType::i64},  {Stored::I8, "I8", 1, DType::i64},
    {Stored::U64, "U64", 8, DType::i64},  {Stored::U32, "U32", 4, DType::i64},
    {Stored::U16, "U16", 2, DType::i64},  {Stored::U8, "U8", 1, DType::i64},
    {Stored::BOOL, "BOOL", 1, DType::i64},
};

const StoredType* find_stored_type(std::string_view name) {
  for (const StoredType& t : kStoredTypes)
    if (name == t.name) return &t;
  return nullptr;
}

const StoredType& stored_type(Stored id) { return kStoredTypes[static_cast<size_t>(id)]; }

std::string supported_dtype_list() {
  std::string list;
  for (const StoredType& t : kStoredTypes) list += (list.empty() ? "" : ", ") + std::string(t.name);
  return list;
}

// ---------------------------------------------------------------------------------------------
// Little-endian access, independent of the host's byte order and of alignment (the buffer starts
// at 8 + N, which a foreign writer need not have padded).

template <class U>
U load_le(const uint8_t* p) {
  U v = 0;
  for (size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(static_cast<U>(p[i]) << (8 * i));
  return v;
}

template <class U>
void store_le(uint8_t* p, U v) {
  for (size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// ---------------------------------------------------------------------------------------------
// Errors

template <class... A>
[[noreturn]] void fail(const std::string& source, const A&... parts) {
  throw IOError(str(source, ": ", parts...));
}

// "an integer", "a string", ...: for messages of the form "shape is <kind>, expected an array".
const char* json_kind(const json& v) {
  switch (v.type()) {
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a floating-point number";
    case json::value_t::string:
      return "a string";
    case json::value_t::object:
      return "an object";
    case json::value_t::array:
      return "an array";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::null:
      return "null";
    default:
      return "not a JSON value";
  }
}

// ---------------------------------------------------------------------------------------------
// Header JSON. A SAX handler instead of json::parse: it rejects duplicate keys (json::parse keeps
// the last one silently), remembers the top-level key order (json objects are sorted maps), caps
// the nesting depth, and reports the byte position of syntax errors.

class HeaderBuilder {
 public:
  json root;
  std::vector<std::string> top_level_keys;  // in header order
  std::string error;                        // why parsing stopped, empty on success

  bool null() { return add_scalar(json(nullptr)); }
  bool boolean(bool v) { return add_scalar(json(v)); }
  bool number_integer(json::number_integer_t v) { return add_scalar(json(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return add_scalar(json(v)); }
  bool number_float(json::number_float_t v, const std::string&) { return add_scalar(json(v)); }
  bool string(std::string& v) { return add_scalar(json(std::move(v))); }
  bool binary(json::binary_t&) {
    error = "binary values are not JSON";
    return false;
  }
  bool start_object(size_t) { return open(json::value_t::object); }
  bool start_array(size_t) { return open(json::value_t::array); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }

  bool key(std::string& k) {
    const json& object = *open_containers_.back();
    if (object.contains(k)) {
      if (open_containers_.size() == 1)
        error = str("duplicate key '", k, "' in the header");
      else
        error = str("duplicate key '", k, "' inside the header entry '", open_keys_[1], "'");
      return false;
    }
    if (open_containers_.size() == 1) top_level_keys.push_back(k);
    pending_key_ = std::move(k);
    return true;
  }

  bool parse_error(size_t, const std::string&, const nlohmann::detail::exception& e) {
    error = e.what();
    return false;
  }

 private:
  // Places v where the parser is (the root, the next array element or the pending key's value) and
  // returns where it landed. Containers on open_containers_ stay put: a parent never grows while
  // a child is open, and object members are map nodes.
  json* add(json&& v) {
    if (open_containers_.empty()) {
      root = std::move(v);
      return &root;
    }
    json& parent = *open_containers_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[pending_key_];
    slot = std::move(v);
    return &slot;
  }

  bool add_scalar(json&& v) {
    add(std::move(v));
    return true;
  }

  bool open(json::value_t kind) {
    if (open_containers_.size() >= kMaxHeaderDepth) {
      error = str("header nests deeper than ", kMaxHeaderDepth, " levels");
      return false;
    }
    std::string key_here = open_containers_.empty() || open_containers_.back()->is_array() ? "" : pending_key_;
    json* slot = add(json(kind));
    open_containers_.push_back(slot);
    open_keys_.push_back(std::move(key_here));
    return true;
  }

  bool close() {
    open_containers_.pop_back();
    open_keys_.pop_back();
    return true;
  }

  std::vector<json*> open_containers_;
  std::vector<std::string> open_keys_;  // the key each open container sits under
  std::string pending_key_;
};

// ---------------------------------------------------------------------------------------------
// Reading

// One header entry after validation, before its bytes are decoded.
struct PendingTensor {
  std::string name;
  const StoredType* type = nullptr;
  Shape shape;
  int64_t numel = 0;
  uint64_t begin = 0;  // relative to the byte buffer
  uint64_t end = 0;
};

// Reads a non-negative integer that must fit in int64 (dims and offsets alike).
bool read_count(const json& v, uint64_t& out) {
  if (v.is_number_unsigned()) {
    out = v.get<uint64_t>();
    return out <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {  // "-0" parses as a signed zero
    out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

std::string describe_number(const json& v) { return v.is_number() ? v.dump() : json_kind(v); }

PendingTensor validate_entry(const std::string& source, const std::string& name, const json& info,
                             uint64_t buffer_size, uint64_t buffer_file_offset) {
  PendingTensor t;
  t.name = name;
  const std::string where = str("tensor '", name, "'");
  if (!info.is_object())
    fail(source, where, ": header entry is ", json_kind(info),
         ", expected an object with dtype, shape and data_offsets");

  // dtype
  auto dtype_it = info.find("dtype");
  if (dtype_it == info.end()) fail(source, where, ": header entry has no \"dtype\"");
  if (!dtype_it->is_string()) fail(source, where, ": dtype is ", json_kind(*dtype_it), ", expected a string");
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  t.type = find_stored_type(dtype_name);
  if (!t.type)
    fail(source, where, ": unknown or unsupported dtype '", dtype_name, "' (supported: ", supported_dtype_list(), ")");

  // shape
  auto shape_it = info.find("shape");
  if (shape_it == info.end()) fail(source, where, ": header entry has no \"shape\"");
  if (!shape_it->is_array()) fail(source, where, ": shape is ", json_kind(*shape_it), ", expected an array");
  if (shape_it->size() > static_cast<size_t>(kMaxDims))
    fail(source, where, ": shape has ", shape_it->size(), " dimensions, this engine supports at most ", kMaxDims);
  // Strides are products of max(dim, 1), so that product must fit in int64 even when a zero dim
  // makes the tensor empty.
  int64_t stride_product = 1, numel = 1;
  for (size_t i = 0; i < shape_it->size(); ++i) {
    const json& d = (*shape_it)[i];
    uint64_t dim = 0;
    if (!read_count(d, dim))
      fail(source, where, ": shape[", i, "] is ", describe_number(d), ", expected a non-negative integer below 2^63");
    const int64_t dim64 = static_cast<int64_t>(dim);
    if (__builtin_mul_overflow(stride_product, std::max<int64_t>(dim64, 1), &stride_product))
      fail(source, where, ": shape ", shape_it->dump(), " has more than 2^63 elements");
    numel *= dim64;  // <= stride_product, cannot overflow
    t.shape.push_back(dim64);
  }
  t.numel = numel;
  uint64_t expected_bytes = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(t.type->bytes), &expected_bytes))
    fail(source, where, ": shape ", shape_it->dump(), " of ", t.type->name, " needs more than 2^64 bytes");

  // data_offsets
  auto offsets_it = info.find("data_offsets");
  if (offsets_it == info.end()) fail(source, where, ": header entry has no \"data_offsets\"");
  if (!offsets_it->is_array() || offsets_it->size() != 2)
    fail(source, where, ": data_offsets is ", offsets_it->dump(), ", expected [begin, end]");
  for (size_t i = 0; i < 2; ++i) {
    uint64_t& value = i == 0 ? t.begin : t.end;
    if (!read_count((*offsets_it)[i], value))
      fail(source, where, ": data_offsets[", i, "] is ", describe_number((*offsets_it)[i]),
           ", expected a non-negative integer");
  }
  if (t.begin > t.end)
    fail(source, where, ": data_offsets [", t.begin, ", ", t.end, "] has begin > end");
  if (t.end > buffer_size)
    fail(source, where, ": data_offsets [", t.begin, ", ", t.end, "] end at file offset ", buffer_file_offset + t.end,
         " lies past the end of the ", buffer_size, "-byte data buffer (file truncated?)");
  if (t.end - t.begin != expected_bytes)
    fail(source, where, ": data_offsets [", t.begin, ", ", t.end, "] span ", t.end - t.begin, " bytes, but shape ",
         t.shape, " of ", t.type->name, " needs ", numel, " x ", t.type->bytes, " = ", expected_bytes, " bytes");
  return t;
}

// The tensors must cover [0, buffer_size) exactly once: a hole hides unaccounted bytes and an
// overlap lets two tensors alias.
void check_tiling(const std::string& source, const std::vector<PendingTensor>& tensors, uint64_t buffer_size,
                  uint64_t buffer_file_offset) {
  std::vector<const PendingTensor*> by_offset;
  by_offset.reserve(tensors.size());
  for (const PendingTensor& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const PendingTensor* a, const PendingTensor* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;
  const PendingTensor* previous = nullptr;
  for (const PendingTensor* t : by_offset) {
    if (t->begin > covered)
      fail(source, "hole in the data buffer: bytes [", covered, ", ", t->begin, ") (file offset ",
           buffer_file_offset + covered, ") belong to no tensor; tensor '", t->name, "' starts at ", t->begin,
           ", expected ", covered);
    if (t->begin < covered)
      fail(source, "tensor '", t->name, "' data_offsets [", t->begin, ", ", t->end, "] overlap tensor '",
           previous->name, "', which ends at ", covered, " (file offset ", buffer_file_offset + covered, ")");
    covered = t->end;
    if (t->end > t->begin) previous = t;
  }
  if (covered != buffer_size)
    fail(source, "the data buffer is ", buffer_size, " bytes but the tensors cover only ", covered, "; bytes from file offset ",
         buffer_file_offset + covered, " on belong to no tensor");
}

float f32_from_bits(uint32_t bits) { return std::bit_cast<float>(bits); }

Tensor decode(const std::string& source, const PendingTensor& t, const uint8_t* bytes, uint64_t file_offset) {
  Tensor out = empty(t.shape, TensorOptions(t.type->engine_dtype));
  const int64_t n = t.numel;
  if (t.type->engine_dtype == DType::f32) {
    float* dst = out.data<float>();
    switch (t.type->id) {
      case Stored::F32:
        for (int64_t i = 0; i < n; ++i) dst[i] = f32_from_bits(load_le<uint32_t>(bytes + 4 * i));
        break;
      case Stored::F64:
        for (int64_t i = 0; i < n; ++i)
          dst[i] = static_cast<float>(std::bit_cast<double>(load_le<uint64_t>(bytes + 8 * i)));
        break;
      case Stored::F16:
        for (int64_t i = 0; i < n; ++i) dst[i] = half_bits_to_float(load_le<uint16_t>(bytes + 2 * i));
        break;
      case Stored::BF16:
        for (int64_t i = 0; i < n; ++i) dst[i] = bfloat16_bits_to_float(load_le<uint16_t>(bytes + 2 * i));
        break;
      default:
        throw RuntimeError(str("safetensors: dtype ", t.type->name, " is not a float dtype"));
    }
    return out;
  }
  int64_t* dst = out.data<int64_t>();
  switch (t.type->id) {
    case Stored::I64:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int64_t>(load_le<uint64_t>(bytes + 8 * i));
      break;
    case Stored::I32:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int32_t>(load_le<uint32_t>(bytes + 4 * i));
      break;
    case Stored::I16:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int16_t>(load_le<uint16_t>(bytes + 2 * i));
      break;
    case Stored::I8:
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int8_t>(bytes[i]);
      break;
    case Stored::U64:
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t v = load_le<uint64_t>(bytes + 8 * i);
        if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          fail(source, "tensor '", t.name, "': U64 element ", i, " at file offset ", file_offset + 8 * i, " is ", v,
               ", which does not fit in i64");
        dst[i] = static_cast<int64_t>(v);
      }
      break;
    case Stored::U32:
      for (int64_t i = 0; i < n; ++i) dst[i] = load_le<uint32_t>(bytes + 4 * i);
      break;
    case Stored::U16:
      for (int64_t i = 0; i < n; ++i) dst[i] = load_le<uint16_t>(bytes + 2 * i);
      break;
    case Stored::U8:
      for (int64_t i = 0; i < n; ++i) dst[i] = bytes[i];
      break;
    case Stored::BOOL:
      for (int64_t i = 0; i < n; ++i) {
        if (bytes[i] > 1)
          fail(source, "tensor '", t.name, "': BOOL element ", i, " at file offset ", file_offset + i, " is ",
               static_cast<int>(bytes[i]), ", expected 0 or 1");
        dst[i] = bytes[i];
      }
      break;
    default:
      throw RuntimeError(str("safetensors: dtype ", t.type->name, " is not an integer dtype"));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writing

// Calls f(value) for every element of a CPU tensor in row-major order, following its strides, so
// views are written without materialising a contiguous copy.
template <class T, class F>
void for_each_element(const Tensor& t, F&& f) {
  const T* base = t.data<T>();
  const int64_t n = t.numel();
  if (n == 0) return;
  const Shape& sizes = t.sizes();
  const Shape& strides = t.strides();
  bool contiguous = true;
  int64_t expected_stride = 1;
  for (int d = sizes.size() - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected_stride) contiguous = false;
    expected_stride *= sizes[d];
  }
  if (contiguous) {
    for (int64_t i = 0; i < n; ++i) f(base[i]);
    return;
  }
  Shape index = Shape::filled(sizes.size(), 0);
  int64_t position = 0;
  for (int64_t i = 0; i < n; ++i) {
    f(base[position]);
    for (int d = sizes.size() - 1; d >= 0; --d) {
      position += strides[d];
      if (++index[d] < sizes[d]) break;
      position -= strides[d] * sizes[d];
      index[d] = 0;
    }
  }
}

// The output dtypes the writer offers for each engine dtype (the first is the default).
constexpr Stored kFloatOutputs[] = {Stored::F32, Stored::F64, Stored::F16, Stored::BF16};
constexpr Stored kIntOutputs[] = {Stored::I64, Stored::I32, Stored::U8};

template <size_t N>
std::string output_list(const Stored (&choices)[N]) {
  std::string list;
  for (Stored s : choices) list += (list.empty() ? "" : ", ") + std::string(stored_type(s).name);
  return list;
}

template <size_t N>
const StoredType* pick_output(const Stored (&choices)[N], std::string_view requested) {
  for (Stored s : choices)
    if (requested == stored_type(s).name) return &stored_type(s);
  return nullptr;
}

std::string dump_json_string(const std::string& s, const std::string& what) {
  try {
    return json(s).dump();
  } catch (const json::exception&) {
    throw ValueError(str("safetensors: ", what, " is not valid UTF-8"));
  }
}

template <class I>
void check_integer_range(const std::string& name, const StoredType& out, int64_t index, int64_t value) {
  if (value < static_cast<int64_t>(std::numeric_limits<I>::min()) ||
      value > static_cast<int64_t>(std::numeric_limits<I>::max()))
    throw ValueError(str("safetensors: tensor '", name, "': element ", index, " is ", value, ", outside the ",
                         out.name, " range [", static_cast<int64_t>(std::numeric_limits<I>::min()), ", ",
                         static_cast<int64_t>(std::numeric_limits<I>::max()), "]"));
}

void encode(const std::string& name, const Tensor& t, const StoredType& out, uint8_t* dst) {
  if (t.dtype() == DType::f32) {
    switch (out.id) {
      case Stored::F32:
        for_each_element<float>(t, [&](float v) {
          store_le(dst, std::bit_cast<uint32_t>(v));
          dst += 4;
        });
        return;
      case Stored::F64:
        for_each_element<float>(t, [&](float v) {
          store_le(dst, std::bit_cast<uint64_t>(static_cast<double>(v)));
          dst += 8;
        });
        return;
      case Stored::F16:
        for_each_element<float>(t, [&](float v) {
          store_le(dst, float_to_half_bits(v));
          dst += 2;
        });
        return;
      case Stored::BF16:
        for_each_element<float>(t, [&](float v) {
          store_le(dst, float_to_bfloat16_bits(v));
          dst += 2;
        });
        return;
      default:
        break;
    }
  } else {
    int64_t index = 0;
    switch (out.id) {
      case Stored::I64:
        for_each_element<int64_t>(t, [&](int64_t v) {
          store_le(dst, static_cast<uint64_t>(v));
          dst += 8;
        });
        return;
      case Stored::I32:
        for_each_element<int64_t>(t, [&](int64_t v) {
          check_integer_range<int32_t>(name, out, index++, v);
          store_le(dst, static_cast<uint32_t>(v));
          dst += 4;
        });
        return;
      case Stored::U8:
        for_each_element<int64_t>(t, [&](int64_t v) {
          check_integer_range<uint8_t>(name, out, index++, v);
          *dst++ = static_cast<uint8_t>(v);
        });
        return;
      default:
        break;
    }
  }
  throw RuntimeError(str("safetensors: no encoder from ", t.dtype(), " to ", out.name));
}

// ---------------------------------------------------------------------------------------------
// Files

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // Closes now and reports close()'s error, which on some file systems is where a failed write
  // first shows up.
  int close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

std::string errno_text(int err) { return std::strerror(err); }

std::string hex_byte(uint8_t b) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02x", b);
  return text;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Half and bfloat16

// One implementation of the conversions for the whole engine: core/half.h.
float half_bits_to_float(uint16_t bits) { return half_bits::f32_from_f16(bits); }
float bfloat16_bits_to_float(uint16_t bits) { return half_bits::f32_from_bf16(bits); }
uint16_t float_to_half_bits(float value) { return half_bits::f16_from_f32(value); }
uint16_t float_to_bfloat16_bits(float value) { return half_bits::bf16_from_f32(value); }

// ---------------------------------------------------------------------------------------------
// File

const Entry* File::find(const std::string& name) const {
  for (const Entry& e : tensors)
    if (e.name == name) return &e;
  return nullptr;
}

std::map<std::string, Tensor> File::state_dict() const {
  std::map<std::string, Tensor> out;
  for (const Entry& e : tensors) out.emplace(e.name, e.tensor);
  return out;
}

bool File::contains(const std::string& name) const { return find(name) != nullptr; }

const Entry& File::entry(const std::string& name) const {
  if (const Entry* e = find(name)) return *e;
  std::string names;
  constexpr size_t kListed = 20;
  for (size_t i = 0; i < tensors.size() && i < kListed; ++i) names += (i ? ", '" : "'") + tensors[i].name + "'";
  if (tensors.size() > kListed) names += str(", ... (", tensors.size(), " in all)");
  throw KeyError(str("safetensors: no tensor named '", name, "'; the file has ",
                     tensors.empty() ? std::string("no tensors") : names));
}

const Tensor& File::at(const std::string& name) const { return entry(name).tensor; }

// ---------------------------------------------------------------------------------------------
// parse / load

File parse(const uint8_t* data, size_t size, const std::string& source_name) {
  const std::string& source = source_name;
  if (data == nullptr && size != 0) throw ValueError(str(source, ": parse() given a null buffer of ", size, " bytes"));
  if (size < kLengthFieldBytes)
    fail(source, "truncated: ", size, " bytes, but a safetensors file starts with an 8-byte header length at offset 0");
  const uint64_t header_size = load_le<uint64_t>(data);
  if (header_size > kMaxHeaderBytes)
    fail(source, "header length ", header_size, " (at offset 0) exceeds the limit of ", kMaxHeaderBytes, " bytes");
  if (header_size > size - kLengthFieldBytes)
    fail(source, "truncated: header length ", header_size, " (at offset 0) runs past the end of the file; only ",
         size - kLengthFieldBytes, " bytes follow offset 8");
  const char* header_text = reinterpret_cast<const char*>(data + kLengthFieldBytes);
  if (header_size == 0 || header_text[0] != '{')
    fail(source, "header is not a JSON object: expected '{' at offset 8, got ",
         header_size == 0 ? std::string("an empty header")
                          : str("byte ", hex_byte(static_cast<uint8_t>(header_text[0]))));

  // nlohmann's lexer takes a NUL byte for the end of input and would ignore whatever follows it;
  // valid JSON never contains a raw NUL.
  if (const void* nul = std::memchr(header_text, 0, header_size))
    fail(source, "bad JSON header: NUL byte at offset ",
         kLengthFieldBytes + static_cast<uint64_t>(static_cast<const char*>(nul) - header_text));

  HeaderBuilder builder;
  bool parsed = false;
  try {
    parsed = json::sax_parse(header_text, header_text + header_size, &builder);
  } catch (const json::exception& e) {
    builder.error = e.what();
  }
  if (!parsed || !builder.error.empty())
    fail(source, "bad JSON header (file offsets 8 to ", kLengthFieldBytes + header_size, "): ",
         builder.error.empty() ? std::string("parser stopped") : builder.error);
  const json& header = builder.root;
  if (!header.is_object()) fail(source, "header is ", json_kind(header), ", expected an object");

  File file;
  const uint64_t buffer_file_offset = kLengthFieldBytes + header_size;
  const uint64_t buffer_size = size - buffer_file_offset;
  const uint8_t* buffer = data + buffer_file_offset;

  std::vector<PendingTensor> pending;
  pending.reserve(builder.top_level_keys.size());
  for (const std::string& key : builder.top_level_keys) {
    const json& value = header.find(key).value();
    if (key == kMetadataKey) {
      if (!value.is_object())
        fail(source, "__metadata__ is ", json_kind(value), ", expected an object of strings");
      for (auto it = value.begin(); it != value.end(); ++it) {
        if (!it->is_string())
          fail(source, "__metadata__ value for key '", it.key(), "' is ", json_kind(*it), ", expected a string");
        file.metadata.emplace(it.key(), it->get<std::string>());
      }
      continue;
    }
    pending.push_back(validate_entry(source, key, value, buffer_size, buffer_file_offset));
  }
  check_tiling(source, pending, buffer_size, buffer_file_offset);

  file.tensors.reserve(pending.size());
  for (const PendingTensor& t : pending)
    file.tensors.push_back(
        Entry{t.name, decode(source, t, buffer + t.begin, buffer_file_offset + t.begin), std::string(t.type->name)});
  return file;
}

File load(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) throw IOError(str("safetensors: file not found: ", path));
    throw IOError(str("safetensors: cannot open ", path, ": ", errno_text(err)));
  }
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) throw IOError(str(path, ": cannot stat: ", errno_text(errno)));
  if (S_ISDIR(info.st_mode)) throw IOError(str(path, ": is a directory, expected a safetensors file"));
  std::vector<uint8_t> bytes;
  // st_size is a hint only (the file may change under us): read until end of file.
  bytes.resize(S_ISREG(info.st_mode) && info.st_size > 0 ? static_cast<size_t>(info.st_size) + 1 : 1 << 16);
  size_t filled = 0;
  for (;;) {
    if (filled == bytes.size()) bytes.resize(bytes.size() * 2);
    const ssize_t got = ::read(fd.get(), bytes.data() + filled, bytes.size() - filled);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw IOError(str(path, ": read failed at offset ", filled, ": ", errno_text(errno)));
    }
    if (got == 0) break;
    filled += static_cast<size_t>(got);
  }
  bytes.resize(filled);
  return parse(bytes.data(), bytes.size(), path);
}

// ---------------------------------------------------------------------------------------------
// serialize / save

std::vector<uint8_t> serialize(const NamedTensors& tensors, const StringMap& metadata, const StringMap& dtypes) {
  struct Planned {
    const std::string* name;
    Tensor host;
    const StoredType* out;
    uint64_t begin, end;
  };
  std::vector<Planned> plan;
  plan.reserve(tensors.size());
  std::map<std::string_view, size_t> seen;
  size_t overrides_used = 0;
  uint64_t buffer_size = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty()) throw ValueError(str("safetensors: tensor #", plan.size(), " has an empty name"));
    if (name == kMetadataKey) throw ValueError("safetensors: '__metadata__' is reserved and cannot name a tensor");
    if (!seen.emplace(name, plan.size()).second)
      throw ValueError(str("safetensors: duplicate tensor name '", name, "' (entries #", seen[name], " and #",
                           plan.size(), ")"));
    if (!tensor.defined()) throw ValueError(str("safetensors: tensor '", name, "' is undefined"));
    const bool is_float = is_floating_point(tensor.dtype());
    // A 16-bit tensor is written in its own format unless an override says otherwise.
    const Stored natural = tensor.dtype() == DType::bf16  ? Stored::BF16
                           : tensor.dtype() == DType::f16 ? Stored::F16
                           : is_float                     ? kFloatOutputs[0]
                                                          : kIntOutputs[0];
    const StoredType* out = &stored_type(natural);
    if (auto it = dtypes.find(name); it != dtypes.end()) {
      ++overrides_used;
      out = is_float ? pick_output(kFloatOutputs, it->second) : pick_output(kIntOutputs, it->second);
      if (!out)
        throw ValueError(str("safetensors: tensor '", name, "' is ", tensor.dtype(), " and cannot be written as '",
                             it->second, "'; choose one of ",
                             is_float ? output_list(kFloatOutputs) : output_list(kIntOutputs)));
    }
    Tensor host = tensor.device().is_cpu() ? tensor : tensor.to(kCPU);
    if (is_reduced_precision(host.dtype())) host = host.to(DType::f32);  // exact; encode() reads f32
    const uint64_t bytes = static_cast<uint64_t>(host.numel()) * out->bytes;
    plan.push_back(Planned{&name, host, out, buffer_size, buffer_size + bytes});
    buffer_size += bytes;
  }
  if (overrides_used != dtypes.size()) {
    for (const auto& [name, dtype] : dtypes)
      if (!seen.count(name))
        throw ValueError(str("safetensors: a dtype override names tensor '", name, "', which is not being written"));
  }

  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      header += first ? "" : ",";
      header += dump_json_string(key, str("metadata key '", key, "'"));
      header += ':';
      header += dump_json_string(value, str("metadata value for '", key, "'"));
      first = false;
    }
    header += '}';
  }
  for (const Planned& p : plan) {
    if (header.size() > 1) header += ',';
    header += dump_json_string(*p.name, str("tensor name '", *p.name, "'"));
    header += str(":{\"dtype\":\"", p.out->name, "\",\"shape\":[");
    for (int d = 0; d < p.host.dim(); ++d) header += str(d ? "," : "", p.host.sizes()[d]);
    header += str("],\"data_offsets\":[", p.begin, ",", p.end, "]}");
  }
  header += '}';
  // Pad with spaces so the buffer starts 8-byte aligned, as the reference writer does.
  header.append((kLengthFieldBytes - (kLengthFieldBytes + header.size()) % kLengthFieldBytes) % kLengthFieldBytes, ' ');

  std::vector<uint8_t> bytes(kLengthFieldBytes + header.size() + buffer_size);
  store_le<uint64_t>(bytes.data(), header.size());
  std::memcpy(bytes.data() + kLengthFieldBytes, header.data(), header.size());
  uint8_t* buffer = bytes.data() + kLengthFieldBytes + header.size();
  for (const Planned& p : plan) encode(*p.name, p.host, *p.out, buffer + p.begin);
  return bytes;
}

namespace {

// Temporary files "<name>.tmp.<pid>.<n>" next to `target` whose writer is gone (killed during a write:
// a crash leaves them behind) are removed; those of a live process are left alone.
void remove_stale_temporaries(const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  const fs::path directory = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string prefix = target.filename().string() + ".tmp.";
  std::error_code ec;
  for (fs::directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());  // "<pid>.<n>"
    const size_t dot = rest.find('.');
    long pid = 0;
    const auto [end_of_pid, parse] = std::from_chars(rest.data(), rest.data() + rest.size(), pid);
    if (parse != std::errc() || dot == std::string::npos || end_of_pid != rest.data() + dot || pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    std::error_code ignored;
    fs::remove(it->path(), ignored);
  }
}

}  // namespace

void write_file_atomically(const std::string& path, const void* data, size_t size) {
  if (path.empty()) throw ValueError("write_file_atomically: needs a non-empty path");
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(target.parent_path(), ec);
    if (ec)
      throw IOError(str("cannot save ", path, ": cannot create directory ", target.parent_path().string(), ": ",
                        ec.message()));
  }
  remove_stale_temporaries(target);

  // pid + counter: concurrent saves from several processes or threads never share a temp file.
  static std::atomic<uint64_t> save_counter{0};
  const std::string temp = str(path, ".tmp.", ::getpid(), ".", save_counter.fetch_add(1));
  auto fail_and_clean = [&](const std::string& step, int err) {
    ::unlink(temp.c_str());
    throw IOError(str("cannot save ", path, ": ", step, " ", temp, ": ", errno_text(err)));
  };

  FileDescriptor fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (fd.get() < 0) {
    const int err = errno;
    throw IOError(str("cannot save ", path, ": cannot create ", temp, ": ", errno_text(err)));
  }
  const auto* bytes = static_cast<const uint8_t*>(data);
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::write(fd.get(), bytes + written, size - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      fd.close();
      fail_and_clean(str("write failed at offset ", written, " of"), err);
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) {
    const int err = errno;
    fd.close();
    fail_and_clean("fsync failed on", err);
  }
  if (fd.close() != 0) fail_and_clean("close failed on", errno);
  if (::rename(temp.c_str(), path.c_str()) != 0) fail_and_clean(str("rename over ", path, " failed for"), errno);

  // Make the rename itself durable; best effort, since some file systems refuse fsync on a directory.
  const std::string directory = target.has_parent_path() ? target.parent_path().string() : std::string(".");
  FileDescriptor dir_fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir_fd.get() >= 0) ::fsync(dir_fd.get());
}

void save(const std::string& path, const NamedTensors& tensors, const StringMap& metadata, const StringMap& dtypes) {
  if (path.empty()) throw ValueError("safetensors: save() needs a non-empty path");
  // Everything that can reject the arguments happens before the disk is touched.
  const std::vector<uint8_t> bytes = serialize(tensors, metadata, dtypes);
  try {
    write_file_atomically(path, bytes.data(), bytes.size());
  } catch (const IOError& e) {
    throw IOError(str("safetensors: ", e.what()));
  }
}

}  // namespace mn::safetensors
