#pragma once
// Error hierarchy: every bad input throws an mn::Error subclass whose message names the argument,
// what was expected and what came. Nothing in the library aborts on user input.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <sstream>
#include <vector>

namespace mn {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};
class ValueError : public Error { public: using Error::Error; };    // bad value/shape/argument
class TypeError : public Error { public: using Error::Error; };     // wrong dtype / kind
class IndexError : public Error { public: using Error::Error; };    // dim or index out of range
class KeyError : public Error { public: using Error::Error; };      // unknown name
class DeviceError : public Error { public: using Error::Error; };   // wrong / unavailable device
class RuntimeError : public Error { public: using Error::Error; };  // state errors (autograd, etc.)
class MemoryError : public Error { public: using Error::Error; };   // out of memory (allocator)
class IOError : public Error { public: using Error::Error; };       // files: missing, truncated, corrupt
class NotImplementedError : public Error { public: using Error::Error; };

namespace detail {
inline void cat_to(std::ostringstream&) {}
template <class T, class... R>
void cat_to(std::ostringstream& os, const T& v, const R&... rest) {
  os << v;
  cat_to(os, rest...);
}
}  // namespace detail

// Concatenate anything streamable into one message.
template <class... A>
std::string str(const A&... a) {
  std::ostringstream os;
  detail::cat_to(os, a...);
  return os.str();
}

// "a, b, c" (with `sep` between the items).
inline std::string joined(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::ostringstream os;
  for (size_t i = 0; i < items.size(); ++i) os << (i ? sep : "") << items[i];
  return os.str();
}

// "[a, b, c]": how error messages list names.
inline std::string bracket_list(const std::vector<std::string>& names) {
  std::string out(1, '[');
  out += joined(names);
  out += ']';
  return out;
}

// 1234567 -> "1,234,567" (sizes in messages and tables).
inline std::string thousands(int64_t v) {
  const std::string digits = std::to_string(v);
  const size_t sign = v < 0 ? 1 : 0;
  std::string out = digits.substr(0, sign);
  for (size_t i = sign; i < digits.size(); ++i) {
    if (i > sign && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace mn

// MN_CHECK(cond, ErrorType, message parts...): throw ErrorType(str(parts...)) when cond is false.
#define MN_CHECK(cond, ErrType, ...)                     \
  do {                                                   \
    if (!(cond)) throw ::mn::ErrType(::mn::str(__VA_ARGS__)); \
  } while (0)
