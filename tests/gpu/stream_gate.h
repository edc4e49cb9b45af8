#pragma once
// Holds a CUDA stream busy until released: a host function on the stream spins on a flag, so
// everything queued behind it waits (a deterministic "kernel still running"). Should a test block on
// the gated stream by mistake (an implicit synchronisation), the gate opens itself after `limit`, so
// the test fails on its checks instead of hanging until ctest's timeout.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "core/cuda.h"

namespace mn::testing {

class StreamGate {
 public:
  explicit StreamGate(const cuda::Stream& s, std::chrono::seconds limit = std::chrono::seconds(20))
      : stream_(s), state_{{false}, std::chrono::steady_clock::now() + limit} {
    REQUIRE(cudaLaunchHostFunc(static_cast<cudaStream_t>(s.handle()), &StreamGate::wait_open, &state_) ==
            cudaSuccess);
  }
  // The host function reads state_: it must have returned before the gate goes away.
  ~StreamGate() {
    release();
    cudaStreamSynchronize(static_cast<cudaStream_t>(stream_.handle()));
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;

  void release() { state_.open.store(true); }

 private:
  struct State {
    std::atomic<bool> open;
    std::chrono::steady_clock::time_point deadline;
  };
  static void wait_open(void* arg) {
    auto* state = static_cast<State*>(arg);
    while (!state->open.load() && std::chrono::steady_clock::now() < state->deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  cuda::Stream stream_;
  State state_;
};

}  // namespace mn::testing
