#include "dist/process_group.h"

#include <cstdlib>
#include <string_view>

#include "core/capture.h"
#include "core/error.h"
#ifdef MN_WITH_GLOO
#include "dist/gloo_process_group.h"
#endif
#ifdef MN_WITH_NCCL
#include "dist/nccl_process_group.h"
#endif
#ifdef MN_WITH_MPI
#include "dist/mpi_process_group.h"
#endif

namespace mn::dist {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

Milliseconds default_collective_timeout() {
  const char* text = std::getenv("MN_DIST_TIMEOUT_S");
  if (text == nullptr || *text == '\0') return Milliseconds(300'000);
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  MN_CHECK(end != text && *end == '\0' && seconds > 0 && seconds < 1e7, ValueError,
           "environment variable MN_DIST_TIMEOUT_S='", text, "' is not a positive number of seconds");
  return Milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

std::vector<std::string> available_backends() {
  std::vector<std::string> out;
#ifdef MN_WITH_GLOO
  out.push_back("gloo");
#endif
#ifdef MN_WITH_NCCL  // CUDA builds with NCCL (always when Gloo is on too)
  out.push_back("nccl");
#endif
#ifdef MN_WITH_MPI  // builds that found MPI (Open MPI from Debian: ./mn deps)
  out.push_back("mpi");
#endif
  return out;
}

bool is_backend_available(const std::string& backend) {
  for (const auto& b : available_backends())
    if (b == backend) return true;
  return false;
}

void check_backend(const std::string& backend) {
  if (is_backend_available(backend)) return;
  if (backend == "mpi")
    throw RuntimeError("backend 'mpi' is not available in this build (built without MPI: install Open MPI with "
                       "`./mn deps` or `apt-get install libopenmpi-dev openmpi-bin`, then configure again with "
                       "MN_WITH_MPI=AUTO or ON); use gloo or nccl");
  if (backend == "ucc")
    throw RuntimeError(str("backend '", backend, "' is not available in this build; use gloo or nccl"));
  if (backend == "nccl")
    throw RuntimeError("backend 'nccl' is not available in this build (built without CUDA or NCCL); use gloo");
  if (backend == "gloo")
    throw RuntimeError("backend 'gloo' is not available in this build (built without Gloo)");
  throw ValueError(str("unknown backend '", backend, "'; choose from: gloo, nccl, mpi"));
}

void check_collective_tensor(const Tensor& tensor, const char* collective, const std::string& backend) {
  // Communication is not a kernel of the recording thread: a captured graph could not repeat it.
  capture::unsupported(str("a ", backend, " ", collective, " of a process group"));
  MN_CHECK(tensor.defined(), ValueError, collective, " got an undefined tensor");
  MN_CHECK(tensor.is_contiguous(), ValueError, collective,
           " needs a contiguous tensor (it works in place), got sizes ", tensor.sizes(), " with strides ",
           tensor.strides(), "; call .contiguous() and copy back");
  const bool want_cuda = backend == "nccl";
  MN_CHECK(tensor.device().is_cuda() == want_cuda, DeviceError, "the ", backend, " backend works on ",
           want_cuda ? "CUDA" : "CPU", " tensors; ", collective, " got a tensor on ", tensor.device(),
           want_cuda ? " (use the gloo backend for CPU tensors)" : " (use the nccl backend for CUDA tensors)");
}

void check_allgather_tensors(const Tensor& input, const Tensor& output, int group_size, const std::string& backend) {
  check_collective_tensor(input, "allgather (input)", backend);
  check_collective_tensor(output, "allgather (output)", backend);
  MN_CHECK(output.dtype() == input.dtype(), TypeError, "allgather output must have the input's dtype ",
           dtype_name(input.dtype()), ", got ", dtype_name(output.dtype()));
  MN_CHECK(output.numel() == input.numel() * group_size, ValueError,
           "allgather output must hold size() * input.numel() = ", group_size, " * ", input.numel(), " = ",
           input.numel() * group_size, " elements, got ", output.numel());
}

std::shared_ptr<ProcessGroup> make_process_group(const std::string& backend, std::shared_ptr<Store> store, int rank,
                                                 int size, ProcessGroupOptions options) {
  check_backend(backend);
#ifdef MN_WITH_GLOO
  if (backend == "gloo")
    return std::make_shared<GlooProcessGroup>(std::move(store), rank, size, std::move(options));
#endif
#ifdef MN_WITH_NCCL
  if (backend == "nccl")
    return std::make_shared<NcclProcessGroup>(std::move(store), rank, size, std::move(options));
#endif
#ifdef MN_WITH_MPI
  if (backend == "mpi") return std::make_shared<MpiProcessGroup>(rank, size, std::move(options));  // no store
#endif
  throw ValueError(str("unknown backend '", backend, "'"));  // check_backend covers every name
}

// ---- the launcher's view of this process, per backend ----

EnvConfig launch_env(const std::string& backend) {
  if (backend != "mpi") return from_env();
  check_backend(backend);  // a build without MPI says so here
  const MpiLaunchEnv from_launcher = from_mpi_env();
  EnvConfig config;
  config.master_addr.clear();  // MPI wires the ranks up itself
  config.master_port = 0;
  if (from_launcher.rank && from_launcher.world_size) {
    config.rank = *from_launcher.rank;
    config.world_size = *from_launcher.world_size;
  } else {
#ifdef MN_WITH_MPI
    const MpiWorld world = mpi_world();  // no (complete) launcher variables: ask MPI itself
    MN_CHECK(!from_launcher.rank || *from_launcher.rank == world.rank, ValueError, from_launcher.rank_source, "=",
             *from_launcher.rank, " but MPI started this process as rank ", world.rank, " of ", world.size);
    config.rank = world.rank;
    config.world_size = world.size;
#endif
  }
  config.local_rank = from_launcher.local_rank.value_or(config.rank);
  config.local_world_size = from_launcher.local_world_size.value_or(config.world_size);
  return config;
}

}  // namespace mn::dist
