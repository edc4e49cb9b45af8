#pragma once
// Checks of command-line values for the example programs (CLI11 validators). CLI11's own numeric checks
// let NaN through (every comparison with it is false), read "-1" into an unsigned seed as 2^64 - 1, and
// report a bound as a 309-digit number; these say what a flag takes and what came.
#include <CLI/CLI.hpp>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "core/error.h"

namespace mn::examples {

inline CLI::Validator whole_number_at_least(int64_t min) {
  return CLI::Validator(
      [min](std::string& text) -> std::string {
        int64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (error == std::errc::result_out_of_range)
          return str("expected a whole number from ", min, " to ", std::numeric_limits<int64_t>::max(), ", got ",
                     text);
        if (error != std::errc() || stop != end || value < min)
          return str("expected a whole number of at least ", min, ", got '", text, "'");
        return "";
      },
      str("INT>=", min));
}

inline CLI::Validator unsigned_whole_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (error != std::errc() || stop != end)
          return str("expected a whole number from 0 to ", std::numeric_limits<uint64_t>::max(), ", got '", text,
                     "'");
        return "";
      },
      "UINT");
}

inline CLI::Validator positive_finite_number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double value = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value) || value <= 0 || errno == ERANGE)
          return str("expected a finite number above 0, got '", text, "'");
        return "";
      },
      "NUMBER>0");
}

}  // namespace mn::examples
