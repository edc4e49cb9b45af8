#include "dist/gloo_process_group.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <future>

#include "core/capture.h"
#include "core/error.h"
#include "dist/gloo_store_adapter.h"

namespace mn::dist {

namespace {

// Written out (not gloo::sum) so the compiler vectorises it: the ring calls it on every segment.
template <class T>
void sum_into(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

// Small all-reduces are latency-bound: Gloo's ring needs 2 (W - 1) message rounds, an all-gather W - 1 (with
// 2 ranks one exchange instead of two, for the same bytes; a DDP step of CNN2 layer-wise sends 10.5 KB).
// Up to this many gathered bytes (W x the tensor) the sum is formed locally from an all-gather, adding the
// ranks' values in rank order, so every rank computes bitwise the same result. MN_GLOO_GATHER_REDUCE_BYTES
// overrides the limit (0: always the ring), for measurements; every rank must see the same value.
constexpr size_t kGatherReduceMaxBytes = size_t{256} << 10;

size_t gather_reduce_max_bytes() {
  const char* v = std::getenv("MN_GLOO_GATHER_REDUCE_BYTES");
  if (v == nullptr || *v == '\0') return kGatherReduceMaxBytes;
  char* end = nullptr;
  const unsigned long long bytes = std::strtoull(v, &end, 10);
  MN_CHECK(end != nullptr && *end == '\0', ValueError, "MN_GLOO_GATHER_REDUCE_BYTES='", v,
           "' is not a byte count");
  return static_cast<size_t>(bytes);
}

template <class T>
void sum_gathered(T* out, const T* rows, size_t n, int ranks) {
  std::memcpy(out, rows, n * sizeof(T));
  for (int r = 1; r < ranks; ++r) sum_into<T>(out, out, rows + static_cast<size_t>(r) * n, n);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

std::string hostname_for_gloo(const ProcessGroupOptions& options) {
  if (!options.gloo_hostname.empty()) return options.gloo_hostname;
  if (is_loopback(options.master_addr)) return "127.0.0.1";
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') return name;
  return "127.0.0.1";
}

// Gloo writes to its peers without MSG_NOSIGNAL, so a peer that died turns the next write into SIGPIPE,
// which would kill this rank silently instead of failing the collective with a message. Python (and so
// PyTorch) ignores SIGPIPE by default; do the same unless the program installed its own handler.
void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
}

// Gloo's TCP transport moves bytes on one event-loop thread per device. Its epoll is level-triggered and
// its pair handler only try-locks the pair, so when the loop wakes while a rank's thread holds that lock
// (sending, posting a receive), it polls again and again until the holder runs. A wake-up preempts the
// thread it interrupts, so where the loop shares a core with the rank's threads (mn-run --bind-cores, or a
// machine the ranks fill) the spin lasts a scheduler slice: 1.8-2.1 ms per small all-reduce instead of
// 0.15 ms (2 ranks bound to a core each, mn_dist_bench allreduce). Under SCHED_BATCH the loop keeps its full
// share of the CPU but no longer preempts on wake-up. (SCHED_IDLE also stops the spin, but its tiny weight
// delays the loop whenever a rank thread is runnable: 0.7 ms instead of 0.2 ms after each DDP backward.)
// MN_GLOO_IO_THREAD=normal keeps Gloo's default, for comparison. Returns false when not applied.
bool stop_event_loop_preempting(const std::shared_ptr<::gloo::transport::Device>& device) {
  const char* mode = std::getenv("MN_GLOO_IO_THREAD");
  const std::string setting = mode == nullptr ? "" : mode;
  MN_CHECK(setting.empty() || setting == "batch" || setting == "normal", ValueError, "MN_GLOO_IO_THREAD='",
           setting, "' must be batch (the default) or normal");
  if (setting == "normal") return false;
  auto tcp = std::dynamic_pointer_cast<::gloo::transport::tcp::Device>(device);
  if (!tcp) return false;
  // Code runs on the loop thread through a handler for an eventfd that is readable at once.
  struct OnLoopThread final : ::gloo::transport::tcp::Handler {
    int fd = -1;
    bool ran = false;  // touched by the loop thread only
    std::promise<bool> applied;
    void handleEvents(int) override {
      uint64_t value = 0;
      if (::read(fd, &value, sizeof(value)) < 0 || ran) return;
      ran = true;
      sched_param param{};
      applied.set_value(sched_setscheduler(0, SCHED_BATCH, &param) == 0);  // 0: the calling thread
    }
  } handler;
  handler.fd = ::eventfd(1, EFD_NONBLOCK | EFD_CLOEXEC);
  if (handler.fd < 0) return false;
  std::future<bool> applied = handler.applied.get_future();
  tcp->registerDescriptor(handler.fd, EPOLLIN, &handler);
  // The loop polls at least every 10 ms; one that does not answer within a second is left as it is.
  const bool answered = applied.wait_for(std::chrono::seconds(1)) == std::future_status::ready;
  tcp->unregisterDescriptor(handler.fd, &handler);  // returns after a loop tick: no call after this
  ::close(handler.fd);
  return answered && applied.get();
}

std::string seconds_text(Milliseconds ms) { return str(static_cast<double>(ms.count()) / 1000.0, " s"); }

std::string describe(const char* collective, const Tensor& t) {
  return str(collective, " of ", t.numel(), " ", dtype_name(t.dtype()), " elements");
}

}  // namespace

// ---- AsyncWork ----

void AsyncWork::wait() {
  if (run_inline_ && !is_completed()) run_inline_(this);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return done_; });
  if (!error_.empty()) throw RuntimeError(error_);
}

bool AsyncWork::is_completed() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

void AsyncWork::finish(std::string error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    error_ = std::move(error);
  }
  done_cv_.notify_all();
}

// ---- GlooProcessGroup ----

GlooProcessGroup::GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size, ProcessGroupOptions options)
    : ProcessGroup(rank, size), options_(std::move(options)) {
  MN_CHECK(store != nullptr, ValueError, "GlooProcessGroup needs a store, got null");
  MN_CHECK(size >= 1, ValueError, "process group size must be at least 1, got ", size);
  MN_CHECK(rank >= 0 && rank < size, ValueError, "rank must be in [0, ", size - 1, "], got ", rank);
  ignore_sigpipe_unless_handled();
  gather_reduce_max_bytes_ = gather_reduce_max_bytes();
  const std::string hostname = hostname_for_gloo(options_);
  // Each group gets its own key prefix: the rank's count of groups made over this store, which is the
  // same on every rank when all create their groups in the same order (threads as ranks included).
  const int64_t group_id = store->add(str("gloo/groups_created_by_rank_", rank), 1);
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    stop_event_loop_preempting(device);
    auto context = std::make_shared<::gloo::rendezvous::Context>(rank, size);
    context->setTimeout(options_.timeout);
    GlooStoreAdapter adapter(std::make_shared<PrefixStore>(str("gloo/", group_id), store));
    context->connectFullMesh(adapter, device);
    context_ = std::move(context);
  } catch (const mn::Error& e) {
    throw RuntimeError(str("Gloo rendezvous failed on rank ", rank, " of ", size, ": ", e.what()));
  } catch (const std::exception& e) {
    throw RuntimeError(str("Gloo rendezvous failed on rank ", rank, " of ", size, " (transport on '", hostname,
                           "', timeout ", seconds_text(options_.timeout), "): ", e.what()));
  }
  worker_ = std::thread([this] { worker_loop(); });
}

GlooProcessGroup::~GlooProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void GlooProcessGroup::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    queue_cv_.wait(lock, [this] { return !running_ && (stopping_ || !queue_.empty()); });
    if (queue_.empty()) return;  // stopping and drained
    std::function<void()> task = std::move(queue_.front().second);
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    task();
    lock.lock();
    running_ = false;
  }
}

void GlooProcessGroup::run_if_next(const AsyncWork* work) {
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ || queue_.empty() || queue_.front().first != work) return;
    task = std::move(queue_.front().second);
    queue_.pop_front();
    running_ = true;
  }
  task();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
  }
  queue_cv_.notify_all();  // the worker may have been woken for this task and gone back to sleep
}

WorkPtr GlooProcessGroup::enqueue(std::string what, std::function<void(uint32_t tag)> run) {
  auto work = std::make_shared<AsyncWork>([this](AsyncWork* w) { run_if_next(w); });
  std::lock_guard<std::mutex> lock(mutex_);
  MN_CHECK(!stopping_, RuntimeError, "Gloo ", what, " issued while the process group is being destroyed");
  const uint32_t tag = next_tag_++;
  std::function<void()> task = [this, work, tag, what = std::move(what), run = std::move(run)] {
    if (!broken_.empty()) {
      work->finish(str("Gloo ", what, " on rank ", rank(), " of ", size(),
                       " was not run: the process group is broken by an earlier failure: ", broken_));
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      run(tag);
      work->finish();
    } catch (const std::exception& e) {
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      broken_ = str("Gloo ", what, " failed on rank ", rank(), " of ", size(), " after ", took, " s: ", e.what(),
                    ". A peer rank may have exited or stopped calling collectives (collective timeout ",
                    seconds_text(options_.timeout), ").");
      work->finish(broken_);
    }
  };
  if (size() == 1) {
    // Nothing to exchange: run it here, under the lock, instead of handing it to the worker and back.
    task();
    return work;
  }
  queue_.emplace_back(work.get(), std::move(task));
  queue_cv_.notify_one();
  return work;
}

WorkPtr GlooProcessGroup::allreduce(const Tensor& tensor, ReduceOp op) {
  check_collective_tensor(tensor, "allreduce", backend());
  MN_CHECK(op != ReduceOp::Avg || tensor.dtype() == DType::f32, TypeError,
           "allreduce with ReduceOp::Avg needs an f32 tensor, got ", dtype_name(tensor.dtype()));
  tensor.bump_version();
  const std::string what = str(describe("allreduce", tensor), " (", reduce_op_name(op), ")");
  return enqueue(what, [this, tensor, op](uint32_t tag) {
    const size_t n = static_cast<size_t>(tensor.numel());
    if (n == 0) return;
    const size_t gathered_bytes = n * dtype_size(tensor.dtype()) * static_cast<size_t>(size());
    if (size() > 1 && gathered_bytes <= gather_reduce_max_bytes_) {
      // Only one collective runs at a time (worker or inline), so the scratch buffer is free here.
      scratch_.resize((gathered_bytes + sizeof(int64_t) - 1) / sizeof(int64_t));
      ::gloo::AllgatherOptions opts(context_);
      if (tensor.dtype() == DType::f32) {
        opts.setInput(tensor.data<float>(), n);
        opts.setOutput(reinterpret_cast<float*>(scratch_.data()), n * static_cast<size_t>(size()));
      } else {
        opts.setInput(tensor.data<int64_t>(), n);
        opts.setOutput(scratch_.data(), n * static_cast<size_t>(size()));
      }
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      ::gloo::allgather(opts);
      if (tensor.dtype() == DType::f32)
        sum_gathered(tensor.data<float>(), reinterpret_cast<const float*>(scratch_.data()), n, size());
      else
        sum_gathered(tensor.data<int64_t>(), scratch_.data(), n, size());
    } else if (size() > 1) {
      ::gloo::AllreduceOptions opts(context_);
      if (tensor.dtype() == DType::f32) {
        opts.setOutput(tensor.data<float>(), n);
        opts.setReduceFunction(&sum_into<float>);
      } else {
        opts.setOutput(tensor.data<int64_t>(), n);
        opts.setReduceFunction(&sum_into<int64_t>);
      }
      opts.setTag(tag);
      opts.setTimeout(options_.timeout);
      ::gloo::allreduce(opts);
    }
    if (op == ReduceOp::Avg && size() > 1) {
      float* p = tensor.data<float>();
      const float world = static_cast<float>(size());
      for (size_t i = 0; i < n; ++i) p[i] /= world;
    }
  });
}

WorkPtr GlooProcessGroup::broadcast(const Tensor& tensor, int root) {
  check_collective_tensor(tensor, "broadcast", backend());
  MN_CHECK(root >= 0 && root < size(), ValueError, "broadcast root must be in [0, ", size() - 1, "], got ", root);
  tensor.bump_version();
  return enqueue(str(describe("broadcast", tensor), " from rank ", root), [this, tensor, root](uint32_t tag) {
    const size_t n = static_cast<size_t>(tensor.numel());
    if (n == 0 || size() == 1) return;
    ::gloo::BroadcastOptions opts(context_);
    if (tensor.dtype() == DType::f32)
      opts.setOutput(tensor.data<float>(), n);
    else
      opts.setOutput(tensor.data<int64_t>(), n);
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    ::gloo::broadcast(opts);
  });
}

WorkPtr GlooProcessGroup::allgather(const Tensor& input, const Tensor& output) {
  check_allgather_tensors(input, output, size(), backend());
  output.bump_version();
  return enqueue(describe("allgather", input), [this, input, output](uint32_t tag) {
    const size_t n = static_cast<size_t>(input.numel());
    if (n == 0) return;
    const size_t bytes = n * dtype_size(input.dtype());
    if (size() == 1) {
      std::memmove(output.raw_data(), input.raw_data(), bytes);
      return;
    }
    ::gloo::AllgatherOptions opts(context_);
    if (input.dtype() == DType::f32) {
      opts.setInput(input.data<float>(), n);
      opts.setOutput(output.data<float>(), n * static_cast<size_t>(size()));
    } else {
      opts.setInput(input.data<int64_t>(), n);
      opts.setOutput(output.data<int64_t>(), n * static_cast<size_t>(size()));
    }
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    ::gloo::allgather(opts);
  });
}

WorkPtr GlooProcessGroup::barrier() {
  capture::unsupported(str("a ", backend(), " barrier of a process group"));
  return enqueue("barrier", [this](uint32_t tag) {
    if (size() == 1) return;
    ::gloo::BarrierOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(options_.timeout);
    ::gloo::barrier(opts);
  });
}

}  // namespace mn::dist
