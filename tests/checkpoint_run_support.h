#pragma once
// For the tests of mid-epoch checkpoints (--checkpoint-every): metrics.csv without its timing column, a
// checkpoint's trainer state, the comparison of two runs' files, and a program started in the background
// so that it can be killed.
#include <doctest/doctest.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "nn/safetensors.h"
#include "tests/temp_dir.h"

namespace mn::testing {

// A metrics CSV without its second column (seconds, the only one that may differ between equal runs).
inline std::string without_seconds(const std::string& path) {
  std::ifstream in(path);
  std::string line, out;
  while (std::getline(in, line)) {
    const size_t a = line.find(','), b = line.find(',', a + 1);
    out += line.substr(0, a) + (b == std::string::npos ? std::string() : line.substr(b)) + "\n";
  }
  return out;
}

// The metadata 'trainer_state' of a checkpoint (either format) as JSON.
inline nlohmann::json checkpoint_trainer_state(const std::string& checkpoint) {
  return nlohmann::json::parse(safetensors::load(checkpoint).metadata.at("trainer_state"));
}

// The files a finished mn-train run leaves in `dir` equal the uninterrupted run's in `straight`: the
// checkpoint and the weights byte for byte, metrics.csv but for its seconds.
inline void check_same_run(const std::string& dir, const std::string& straight) {
  CHECK(read_bytes(dir + "/checkpoint.safetensors") == read_bytes(straight + "/checkpoint.safetensors"));
  CHECK(read_bytes(dir + "/weights.safetensors") == read_bytes(straight + "/weights.safetensors"));
  CHECK(without_seconds(dir + "/metrics.csv") == without_seconds(straight + "/metrics.csv"));
}

// Runs `command` through /bin/sh in the background with its output discarded; the shell execs the
// command, so the pid returned is the program's own. -1 when fork fails.
inline pid_t spawn_command(const std::string& command) {
  const std::string line = "exec " + command + " >/dev/null 2>&1";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return pid;
}

}  // namespace mn::testing
