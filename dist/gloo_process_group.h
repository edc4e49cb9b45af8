#pragma once
// The CPU process group: Gloo's TCP transport, connected through our store. One worker thread runs the
// collectives in issue order, so each returns a Work at once and the caller keeps computing.
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dist/process_group.h"

namespace gloo {
class Context;
}

namespace mn::dist {

// A Work completed by a background thread (shared by the CPU backends and tests).
class AsyncWork final : public Work {
 public:
  // run_inline(this), when given, may run the collective in the waiting thread if it has not started yet
  // (see GlooProcessGroup::run_if_next).
  explicit AsyncWork(std::function<void(AsyncWork*)> run_inline = {}) : run_inline_(std::move(run_inline)) {}
  void wait() override;
  bool is_completed() override;
  // Called once by the thread that ran the collective; an empty error means success.
  void finish(std::string error = {});

 private:
  std::function<void(AsyncWork*)> run_inline_;
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::string error_;
};

class GlooProcessGroup final : public ProcessGroup {
 public:
  // Rendezvous through `store` (every rank of the group calls this with the same store contents).
  GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options = {});
  ~GlooProcessGroup() override;

  std::string backend() const override { return "gloo"; }
  WorkPtr allreduce(const Tensor& tensor, ReduceOp op = ReduceOp::Sum) override;
  WorkPtr broadcast(const Tensor& tensor, int root = 0) override;
  WorkPtr allgather(const Tensor& input, const Tensor& output) override;
  WorkPtr barrier() override;

  Milliseconds timeout() const { return options_.timeout; }

 private:
  // Queues `run` on the worker; `what` describes the collective for error messages.
  WorkPtr enqueue(std::string what, std::function<void(uint32_t tag)> run);
  void worker_loop();
  // Runs `work` in the calling thread when it is next in line and nothing runs: a thread that waits anyway
  // then saves two thread hand-offs, the bulk of a small collective's latency on a busy machine. Order
  // and mutual exclusion are those of the worker.
  void run_if_next(const AsyncWork* work);

  ProcessGroupOptions options_;
  std::shared_ptr<::gloo::Context> context_;
  std::mutex mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<const AsyncWork*, std::function<void()>>> queue_;
  bool running_ = false;  // a collective is executing (on the worker or inline)
  bool stopping_ = false;
  uint32_t next_tag_ = 0;
  std::string broken_;  // first failure; later collectives fail at once with it (worker thread only)
  std::vector<int64_t> scratch_;  // small all-reduces gather here (one collective runs at a time)
  size_t gather_reduce_max_bytes_ = 0;  // all-reduces up to this many gathered bytes: all-gather + local sum
  std::thread worker_;
};

}  // namespace mn::dist
