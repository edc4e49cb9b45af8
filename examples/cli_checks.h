#pragma once
// What the example programs share on their command lines: checks of values (CLI11 validators),
// --version, and --config / --write-config. CLI11's own numeric checks let NaN through (every
// comparison with it is false), read "-1" into an unsigned seed as 2^64 - 1, clamp a whole number too
// large for its type, and report a bound as a 309-digit number; these say what a flag takes and what came.
#include <CLI/CLI.hpp>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "core/error.h"

// The project's version (project(VERSION) in CMakeLists.txt), set by examples/CMakeLists.txt.
#ifndef MN_VERSION
#error "MN_VERSION must be defined (examples/CMakeLists.txt passes the project version)"
#endif

namespace mn::examples {

// A whole number from min to max (inclusive). With max the largest int64 (whole_number_at_least) the
// bound is named only for a value beyond it.
inline CLI::Validator whole_number_in_range(int64_t min, int64_t max) {
  const bool bounded = max != std::numeric_limits<int64_t>::max();
  return CLI::Validator(
      [min, max, bounded](std::string& text) -> std::string {
        int64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        const bool whole = error != std::errc::invalid_argument && stop == end && !text.empty();
        if (bounded || error == std::errc::result_out_of_range) {
          if (!whole || error != std::errc() || value < min || value > max)
            return str("expected a whole number from ", min, " to ", max, ", got '", text, "'");
        } else if (!whole || value < min) {
          return str("expected a whole number of at least ", min, ", got '", text, "'");
        }
        return "";
      },
      bounded ? str("INT in [", min, ", ", max, "]") : str("INT>=", min));
}

inline CLI::Validator whole_number_at_least(int64_t min) {
  return whole_number_in_range(min, std::numeric_limits<int64_t>::max());
}

// A finite number from min to max (inclusive; no upper bound named when max is infinite).
inline CLI::Validator finite_number_in_range(double min, double max = std::numeric_limits<double>::infinity()) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double value = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(value) || value < min ||
            value > max || errno == ERANGE)
          return std::isinf(max) ? str("expected a finite number of at least ", min, ", got '", text, "'")
                                 : str("expected a number from ", min, " to ", max, ", got '", text, "'");
        return "";
      },
      std::isinf(max) ? str("NUMBER>=", min) : str("NUMBER in [", min, ", ", max, "]"));
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

// "1 epoch", "3 epochs".
inline std::string count_of(int64_t n, const std::string& noun) { return str(n, " ", noun, n == 1 ? "" : "s"); }

// --version: prints "<program> <project version>" and exits 0.
inline void add_version_flag(CLI::App& app, const std::string& program) {
  app.set_version_flag("--version", program + " " + MN_VERSION, "print the program's version and exit");
}

// --config FILE reads options from a TOML (or INI) file, key = value with the long flag's name
// (`epochs = 3`, `mlp-hidden = [64, 32]`); flags on the command line override it, and an unknown key
// is an error. --write-config FILE writes every option's value (the defaults, the file's, the
// command line's) in that format and exits: `--config FILE` then runs the same. write_path receives
// --write-config's value.
inline void add_config_options(CLI::App& app, std::string& write_path) {
  app.set_config("--config", "", "read options from this TOML file (key = value per long flag; flags given override it)")
      ->type_name("FILE");
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.add_option("--write-config", write_path,
                 "write the effective options (defaults, --config, flags) as a TOML file for --config, and exit")
      ->type_name("FILE")
      ->configurable(false);
}

// After parsing: when --write-config was given, writes the configuration and returns true (the program
// then exits 0); an unwritable file is an IOError.
inline bool write_config_if_asked(const CLI::App& app, const std::string& write_path, const std::string& program) {
  if (write_path.empty()) return false;
  std::ofstream out(write_path);
  out << "# " << program << " " << MN_VERSION << " options; run with: " << program << " --config " << write_path
      << "\n";
  // CLI11 writes `key=""` for an option with no value and no default to show (--lr: chosen by the
  // program); left out, it keeps its default when read back, where "" would fail the option's check.
  std::istringstream lines(app.config_to_str(true, false));
  for (std::string line; std::getline(lines, line);)
    if (line.size() < 3 || line.compare(line.size() - 3, 3, "=\"\"") != 0) out << line << "\n";
  out.flush();
  MN_CHECK(out.good(), IOError, "--write-config ", write_path, ": cannot write the file: ", std::strerror(errno));
  std::printf("wrote %s (run it with --config %s)\n", write_path.c_str(), write_path.c_str());
  return true;
}

}  // namespace mn::examples
