#pragma once
// For the tests that run the mn-train example: where its binary is (next to the test executable,
// <build>/examples/mn-train, or $MN_TRAIN_EXE) and whether Fashion-MNIST is installed. ready() says
// why a case is skipped when either is missing.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "nn/data/fashion_mnist.h"

namespace mn::testing {

// "" when the binary is not found.
inline std::string mn_train_exe() {
  if (const char* env = std::getenv("MN_TRAIN_EXE"); env != nullptr && *env) return env;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const std::filesystem::path candidate = self.parent_path().parent_path() / "examples" / "mn-train";
  return std::filesystem::exists(candidate) ? candidate.string() : "";
}

inline bool have_fashion_mnist() {
  const std::filesystem::path root = data::default_fashion_mnist_root();
  return std::filesystem::exists(root / "train-images-idx3-ubyte.gz") ||
         std::filesystem::exists(root / "train-images-idx3-ubyte");
}

// Sets exe and returns true when both the binary and the data are there; otherwise reports the case
// skipped, with what is missing, and returns false.
inline bool mn_train_ready(std::string& exe) {
  exe = mn_train_exe();
  if (exe.empty()) {
    MESSAGE("skipped: mn-train not built next to the tests (build target mn-train, or set MN_TRAIN_EXE)");
    return false;
  }
  if (!have_fashion_mnist()) {
    MESSAGE("skipped: Fashion-MNIST not found in "
            << data::default_fashion_mnist_root()
            << " (install dataset-fashion-mnist or set MN_FASHION_MNIST_DIR)");
    return false;
  }
  return true;
}

}  // namespace mn::testing
