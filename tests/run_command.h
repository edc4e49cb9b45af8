#pragma once
// Runs a shell command line for the tests that drive the example programs (mn-train, mn-run): its exit
// status, and stdout and stderr kept apart (stderr goes through a temporary file, so neither pipe can
// fill up and block the other).
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace mn::testing {

// The non-empty lines of `text`.
inline std::vector<std::string> nonempty_lines(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) lines.push_back(line);
  return lines;
}

struct CommandResult {
  int status = -1;  // the exit code; -1 when the command did not exit normally
  std::string out;  // stdout
  std::string err;  // stderr
  std::string all() const { return out + err; }  // for messages and searches
  // The last non-empty line of stdout ("" when there is none).
  std::string last_line() const {
    const std::vector<std::string> lines = nonempty_lines(out);
    return lines.empty() ? std::string() : lines.back();
  }
};

inline CommandResult run_command(const std::string& command) {
  static std::atomic<int> counter{0};
  const std::filesystem::path err_file = std::filesystem::temp_directory_path() /
                                         ("mn_test_stderr_" + std::to_string(::getpid()) + "_" +
                                          std::to_string(counter++));
  CommandResult r;
  FILE* pipe = ::popen((command + " 2>" + err_file.string()).c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) r.out.append(buffer.data(), n);
  const int raw = ::pclose(pipe);
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  {
    std::ifstream in(err_file);
    std::stringstream text;
    text << in.rdbuf();
    r.err = text.str();
  }
  std::error_code ec;
  std::filesystem::remove(err_file, ec);
  return r;
}

}  // namespace mn::testing
