#include "dist/mpi_process_group.h"

// The C interface only: no C++ bindings (which Open MPI's mpi.h would otherwise pull in).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/capture.h"
#include "core/error.h"

namespace mn::dist {

namespace {

// Every MPI call made here runs under this mutex: MPI_THREAD_SERIALIZED is all MPI must provide.
std::mutex g_mpi_mutex;

// Process-wide state, guarded by g_mpi_mutex.
struct MpiRuntime {
  bool we_initialized = false;  // MPI_Init_thread was ours, so MPI_Finalize is too
  bool exiting = false;         // the atexit handler ran: groups destroyed later do not wait for peers
  int live_groups = 0;
  bool failed = false;  // a collective failed or timed out somewhere in this process
};
MpiRuntime g_runtime;

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return str("MPI error code ", code);
  return std::string(text, static_cast<size_t>(length));
}

void check_mpi(int code, const char* call) {
  if (code != MPI_SUCCESS) throw RuntimeError(str(call, " failed: ", mpi_error_text(code)));
}

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "MPI_THREAD_MULTIPLE";
  }
}

// Finalises MPI when we initialised it and the job ends cleanly here (see the header).
void finalize_at_exit() {
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  g_runtime.exiting = true;
  if (!g_runtime.we_initialized || g_runtime.live_groups > 0 || g_runtime.failed) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0) MPI_Finalize();
}

// Initialises MPI unless someone did; checks the thread level. The caller holds g_mpi_mutex.
void ensure_initialized_locked() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  MN_CHECK(finalized == 0, RuntimeError, "the mpi backend cannot start: MPI was already finalized in this process");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (initialized == 0) {
    // Open MPI's nonblocking all-reduce (libnbc) picks a binomial tree (reduce to one rank, then broadcast)
    // for fewer than 4 ranks or in-place buffers, which ours always are: at 64 MiB over 2 ranks half the
    // bandwidth of its blocking all-reduce. Its ring matches or beats the blocking one at 64 KiB and up and
    // costs a microsecond or two below. Only when the user (mpirun --mca, or the variable) chose nothing;
    // every rank sees the same environment, so all pick the same algorithm.
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
    check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
    g_runtime.we_initialized = true;
    std::atexit(finalize_at_exit);
    // Our queries of MPI_COMM_WORLD and its duplication return their errors too.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  } else {
    check_mpi(MPI_Query_thread(&provided), "MPI_Query_thread");
  }
  MN_CHECK(provided >= MPI_THREAD_SERIALIZED, RuntimeError, "the mpi backend needs MPI_THREAD_SERIALIZED (its calls "
           "come from whichever thread issues or waits, one at a time), but MPI provides only ",
           thread_level_name(provided),
           initialized ? " (the program initialised MPI: call MPI_Init_thread asking for MPI_THREAD_SERIALIZED)" : "");
}

MPI_Datatype mpi_type(DType dtype) { return dtype == DType::f32 ? MPI_FLOAT : MPI_INT64_T; }

// Calls issue(offset, count) for consecutive pieces of n elements that MPI's int counts can hold.
int for_each_piece(int64_t n, const std::function<int(int64_t, int)>& issue) {
  for (int64_t offset = 0; offset < n; offset += INT_MAX) {
    const int code = issue(offset, static_cast<int>(std::min<int64_t>(n - offset, INT_MAX)));
    if (code != MPI_SUCCESS) return code;
  }
  return MPI_SUCCESS;
}

std::string describe(const char* collective, const Tensor& t) {
  return str(collective, " of ", t.numel(), " ", dtype_name(t.dtype()), " elements");
}

std::string seconds_text(Milliseconds ms) { return str(static_cast<double>(ms.count()) / 1000.0, " s"); }

constexpr std::chrono::microseconds kNap{50};

// How long a wait polls without pause: MN_MPI_SPIN_US (microseconds; every rank may differ), else 200 us.
std::chrono::microseconds spin_before_napping() {
  const char* text = std::getenv("MN_MPI_SPIN_US");
  if (text == nullptr || *text == '\0') return std::chrono::microseconds(200);
  char* end = nullptr;
  const long long us = std::strtoll(text, &end, 10);
  MN_CHECK(end != text && *end == '\0' && us >= 0, ValueError, "MN_MPI_SPIN_US='", text,
           "' is not a number of microseconds");
  return std::chrono::microseconds(us);
}

// One collective in flight.
struct MpiOp {
  std::string what;
  std::vector<MPI_Request> requests;
  std::vector<Tensor> tensors;       // what MPI reads or writes, alive until the requests completed
  std::function<void()> on_success;  // runs once when the requests completed (Avg's division)
  bool done = false;
  std::string error;
};

// Operations that failed while MPI may still touch their tensors: kept for the rest of the process.
std::vector<std::shared_ptr<MpiOp>>& abandoned_ops() {
  static auto* ops = new std::vector<std::shared_ptr<MpiOp>>();
  return *ops;
}

}  // namespace

MpiWorld mpi_world() {
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  ensure_initialized_locked();
  MpiWorld world;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world.rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world.size), "MPI_Comm_size");
  return world;
}

// Everything below that touches MPI or the group's state holds g_mpi_mutex.
struct MpiProcessGroup::Impl : std::enable_shared_from_this<MpiProcessGroup::Impl> {
  int rank = 0;
  int size = 1;
  ProcessGroupOptions options;
  MPI_Comm comm = MPI_COMM_NULL;
  std::deque<std::shared_ptr<MpiOp>> pending;  // issued and not yet seen complete
  std::string broken;                          // the first failure
  std::chrono::microseconds spin = spin_before_napping();

  void fail(const std::shared_ptr<MpiOp>& op, std::string message) {
    op->done = true;
    op->error = std::move(message);
    if (broken.empty()) broken = op->error;
    g_runtime.failed = true;
    abandoned_ops().push_back(op);
  }

  // True once `op` finished; tests its requests (which drives MPI's progress for every pending one).
  bool progress(const std::shared_ptr<MpiOp>& op) {
    if (op->done) return true;
    int flag = 0;
    const int code = MPI_Testall(static_cast<int>(op->requests.size()), op->requests.data(), &flag,
                                 MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      fail(op, str("MPI ", op->what, " failed on rank ", rank, " of ", size, ": ", mpi_error_text(code)));
      return true;
    }
    if (flag == 0) return false;
    op->done = true;
    try {
      if (op->on_success) op->on_success();
    } catch (const std::exception& e) {
      op->error = e.what();
    }
    op->tensors.clear();
    return true;
  }

  void reap() {
    while (!pending.empty() && progress(pending.front())) pending.pop_front();
  }

  // Polls `op` until it finished or `timeout` passed; true when it finished. MPI has no blocking wait that
  // sleeps (Open MPI's own spins), so the first `spin` of a wait polls flat out: a partner that is there
  // answers within microseconds. After that the waiting thread naps between polls: a rank that waits for a
  // slower one then leaves its core to the machine's other work (a spinning rank under a loaded scheduler
  // is served later once it has work again: DDP steps 1.25x slower than Gloo's sleeping waits), at the
  // cost of up to a nap's latency.
  bool poll(const std::shared_ptr<MpiOp>& op, std::unique_lock<std::mutex>& lock) {
    const auto start = std::chrono::steady_clock::now();
    std::chrono::steady_clock::duration waited{};
    for (uint64_t polls = 1;; ++polls) {
      if (progress(op)) return true;
      if (waited < spin && polls % 64 != 0) continue;
      waited = std::chrono::steady_clock::now() - start;
      if (waited >= options.timeout) return false;
      if (waited < spin) continue;
      lock.unlock();
      std::this_thread::sleep_for(kNap);
      lock.lock();
    }
  }

  WorkPtr issue(std::string what, std::vector<Tensor> tensors, const std::function<int(MpiOp&)>& start,
                std::function<void()> on_success = {});
};

namespace {

class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<MpiProcessGroup::Impl> group, std::shared_ptr<MpiOp> op)
      : group_(std::move(group)), op_(std::move(op)) {}

  void wait() override {
    std::unique_lock<std::mutex> lock(g_mpi_mutex);
    if (!group_->poll(op_, lock))
      group_->fail(op_, str("MPI ", op_->what, " on rank ", group_->rank, " of ", group_->size,
                            " did not complete within the collective timeout of ", seconds_text(group_->options.timeout),
                            ": a peer rank may have exited or stopped calling collectives"));
    if (!op_->error.empty()) throw RuntimeError(op_->error);
  }

  bool is_completed() override {
    std::lock_guard<std::mutex> lock(g_mpi_mutex);
    return group_->progress(op_);
  }

 private:
  std::shared_ptr<MpiProcessGroup::Impl> group_;
  std::shared_ptr<MpiOp> op_;
};

}  // namespace

WorkPtr MpiProcessGroup::Impl::issue(std::string what, std::vector<Tensor> tensors,
                                     const std::function<int(MpiOp&)>& start, std::function<void()> on_success) {
  auto op = std::make_shared<MpiOp>();
  op->what = std::move(what);
  op->tensors = std::move(tensors);
  op->on_success = std::move(on_success);
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  reap();  // earlier collectives move on, and finished ones are dropped
  if (!broken.empty()) {
    op->done = true;
    op->error = str("MPI ", op->what, " on rank ", rank, " of ", size,
                    " was not run: the process group is broken by an earlier failure: ", broken);
  } else if (const int code = start(*op); code != MPI_SUCCESS) {
    fail(op, str("MPI ", op->what, " could not start on rank ", rank, " of ", size, ": ", mpi_error_text(code)));
  } else {
    pending.push_back(op);
  }
  return std::make_shared<MpiWork>(shared_from_this(), op);
}

// ---- MpiProcessGroup ----

MpiProcessGroup::MpiProcessGroup(int rank, int size, ProcessGroupOptions options)
    : ProcessGroup(rank, size), impl_(std::make_shared<Impl>()) {
  MN_CHECK(size >= 1, ValueError, "process group size must be at least 1, got ", size);
  MN_CHECK(rank >= 0 && rank < size, ValueError, "rank must be in [0, ", size - 1, "], got ", rank);
  MN_CHECK(options.timeout.count() > 0, ValueError, "the collective timeout must be positive, got ",
           options.timeout.count(), " ms");
  impl_->rank = rank;
  impl_->size = size;
  impl_->options = std::move(options);
  std::lock_guard<std::mutex> lock(g_mpi_mutex);
  ensure_initialized_locked();
  int world_rank = 0, world_size = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &world_size), "MPI_Comm_size");
  MN_CHECK(world_rank == rank && world_size == size, ValueError, "the mpi backend was asked for rank ", rank, " of ",
           size, " (RANK and WORLD_SIZE, or setup_ddp's arguments), but MPI started this process as rank ",
           world_rank, " of ", world_size, "; they must agree (start the ranks with mpirun -np N, which gives both)");
  // A communicator of our own: our collectives never match the program's own MPI traffic.
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->comm), "MPI_Comm_dup");
  check_mpi(MPI_Comm_set_errhandler(impl_->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  ++g_runtime.live_groups;
}

MpiProcessGroup::~MpiProcessGroup() {
  std::unique_lock<std::mutex> lock(g_mpi_mutex);
  // Collectives still in flight finish first (their tensors and our communicator stay valid until then),
  // unless the process is exiting or the group failed: then nobody may be left to finish them.
  bool clean = impl_->broken.empty();
  for (const auto& op : impl_->pending) {
    if (!clean || g_runtime.exiting || !impl_->poll(op, lock)) {
      clean = false;
      if (!op->done) impl_->fail(op, str("MPI ", op->what, " was still running when its process group was destroyed"));
    }
  }
  impl_->pending.clear();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized == 0 && impl_->comm != MPI_COMM_NULL) MPI_Comm_free(&impl_->comm);
  --g_runtime.live_groups;
}

WorkPtr MpiProcessGroup::allreduce(const Tensor& tensor, ReduceOp op) {
  check_collective_tensor(tensor, "allreduce", backend());
  MN_CHECK(op != ReduceOp::Avg || tensor.dtype() == DType::f32, TypeError,
           "allreduce with ReduceOp::Avg needs an f32 tensor, got ", dtype_name(tensor.dtype()));
  tensor.bump_version();
  std::function<void()> average;
  if (op == ReduceOp::Avg && size() > 1)
    average = [tensor, world = static_cast<float>(size())] {
      float* p = tensor.data<float>();
      for (int64_t i = 0, n = tensor.numel(); i < n; ++i) p[i] /= world;
    };
  Impl& g = *impl_;
  return g.issue(str(describe("allreduce", tensor), " (", reduce_op_name(op), ")"), {tensor},
                 [&g, &tensor](MpiOp& mop) {
                   char* base = static_cast<char*>(tensor.raw_data());
                   const size_t item = dtype_size(tensor.dtype());
                   return for_each_piece(tensor.numel(), [&](int64_t offset, int count) {
                     mop.requests.emplace_back();
                     return MPI_Iallreduce(MPI_IN_PLACE, base + static_cast<size_t>(offset) * item, count,
                                           mpi_type(tensor.dtype()), MPI_SUM, g.comm, &mop.requests.back());
                   });
                 },
                 std::move(average));
}

WorkPtr MpiProcessGroup::broadcast(const Tensor& tensor, int root) {
  check_collective_tensor(tensor, "broadcast", backend());
  MN_CHECK(root >= 0 && root < size(), ValueError, "broadcast root must be in [0, ", size() - 1, "], got ", root);
  tensor.bump_version();
  Impl& g = *impl_;
  return g.issue(str(describe("broadcast", tensor), " from rank ", root), {tensor}, [&g, &tensor, root](MpiOp& mop) {
    char* base = static_cast<char*>(tensor.raw_data());
    const size_t item = dtype_size(tensor.dtype());
    return for_each_piece(tensor.numel(), [&](int64_t offset, int count) {
      mop.requests.emplace_back();
      return MPI_Ibcast(base + static_cast<size_t>(offset) * item, count, mpi_type(tensor.dtype()), root, g.comm,
                        &mop.requests.back());
    });
  });
}

WorkPtr MpiProcessGroup::allgather(const Tensor& input, const Tensor& output) {
  check_allgather_tensors(input, output, size(), backend());
  MN_CHECK(input.numel() <= INT_MAX, ValueError, "the mpi backend's allgather takes at most ", INT_MAX,
           " elements per rank (MPI counts are int), got ", input.numel());
  output.bump_version();
  Impl& g = *impl_;
  return g.issue(describe("allgather", input), {input, output}, [&g, &input, &output](MpiOp& mop) {
    if (input.numel() == 0) return MPI_SUCCESS;
    mop.requests.emplace_back();
    const int count = static_cast<int>(input.numel());
    return MPI_Iallgather(input.raw_data(), count, mpi_type(input.dtype()), output.raw_data(), count,
                          mpi_type(input.dtype()), g.comm, &mop.requests.back());
  });
}

WorkPtr MpiProcessGroup::barrier() {
  capture::unsupported(str("a ", backend(), " barrier of a process group"));
  Impl& g = *impl_;
  return g.issue("barrier", {}, [&g](MpiOp& mop) {
    mop.requests.emplace_back();
    return MPI_Ibarrier(g.comm, &mop.requests.back());
  });
}

}  // namespace mn::dist
