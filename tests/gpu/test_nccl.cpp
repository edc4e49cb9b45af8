// The NCCL process group and DDP over it, on one device: NCCL refuses two ranks on one GPU, so with a
// single GPU the group has one rank. That still runs every collective through NCCL on the group's own
// stream, so what is checked here is the stream ordering (inputs made by kernels just queued on the
// compute stream, results read by kernels queued after wait()), the allocator's record_stream for
// tensors dropped while a collective is in flight, dtypes, sizes and errors. In builds without NCCL both
// cases are reported as skipped. Compiled only in CUDA builds (the stream gate needs the CUDA runtime
// headers); without CUDA main.cpp reports the GPU tests skipped anyway.
#ifdef MN_WITH_CUDA
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#include "autograd/ops.h"
#include "core/allocator.h"
#include "core/caching_allocator.h"
#include "core/cuda.h"
#include "dist/ddp.h"
#include "dist/process_group.h"
#include "dist/store.h"
#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "tests/gpu/stream_gate.h"
#include "tests/test_support.h"

using namespace mn;

namespace {

const Device kGpu = cuda_device(0);

std::shared_ptr<dist::ProcessGroup> one_rank_nccl_group() {
  dist::ProcessGroupOptions options;
  options.device_index = 0;
  return dist::make_process_group("nccl", std::make_shared<dist::HashStore>(), 0, 1, options);
}

}  // namespace

TEST_CASE("gpu: NCCL process group, one rank: collectives in stream order, dtypes, sizes, errors" *
          doctest::skip(!dist::is_backend_available("nccl"))) {
  auto pg = one_rank_nccl_group();
  CHECK(pg->backend() == "nccl");
  CHECK(pg->size() == 1);

  for (int64_t n : {int64_t{1}, int64_t{1023}, int64_t{10'000'000}}) {
    INFO("n = ", n);
    std::vector<float> host(static_cast<size_t>(n));
    std::iota(host.begin(), host.end(), 0.0f);
    for (float& v : host) v = static_cast<float>(static_cast<int64_t>(v) % 7);
    // Made by a kernel queued just before the collective: NCCL must wait for it.
    Tensor x = mul(from_vector(host, Shape{n}).to(kGpu), 3.0).contiguous();
    pg->allreduce(x, dist::ReduceOp::Sum)->wait();
    Tensor doubled = mul(x, 2.0);  // queued after wait(): must see the collective's result
    const std::vector<float> got = doubled.to(kCPU).to_vector<float>();
    bool all_equal = got.size() == host.size();
    for (size_t i = 0; all_equal && i < got.size(); ++i) all_equal = got[i] == host[i] * 6.0f;
    CHECK(all_equal);

    Tensor avg = mul(from_vector(host, Shape{n}).to(kGpu), 1.0).contiguous();
    pg->allreduce(avg, dist::ReduceOp::Avg)->wait();
    CHECK(avg.to(kCPU).to_vector<float>() == host);
  }

  Tensor counts = from_vector(std::vector<int64_t>{5, -2, 7}, Shape{3}).to(kGpu);
  pg->allreduce(counts)->wait();
  CHECK(counts.to(kCPU).to_vector<int64_t>() == std::vector<int64_t>{5, -2, 7});

  Tensor root = from_vector(std::vector<float>{1.5f, 2.5f}, Shape{2}).to(kGpu);
  pg->broadcast(root, 0)->wait();
  CHECK(root.to(kCPU).to_vector<float>() == std::vector<float>{1.5f, 2.5f});

  Tensor in = from_vector(std::vector<float>{4.0f, 5.0f, 6.0f}, Shape{3}).to(kGpu);
  Tensor out = zeros({3}, TensorOptions().with_device(kGpu));
  pg->allgather(in, out)->wait();
  CHECK(out.to(kCPU).to_vector<float>() == std::vector<float>{4.0f, 5.0f, 6.0f});
  pg->barrier()->wait();

  // A tensor dropped, with its unwaited Work, while its collective cannot have run: the compute stream
  // (a side stream made current) is held by a host function and the NCCL stream waits for it. Only
  // record_stream keeps the block out of the pool (the Work's keep-alive is gone with the Work) until the
  // NCCL stream has passed the collective. (MN_NO_CACHING: nothing is pooled, nothing to check.)
  if (caching_enabled(kGpu)) {
    const cuda::Stream compute = cuda::new_stream(0);
    cuda::StreamGuard on_compute(compute);
    empty_cache(kGpu);
    const int64_t n = int64_t{1} << 22;  // 16 MiB: a segment of its own
    void* dropped = nullptr;
    testing::StreamGate gate(compute);
    {
      Tensor temp = empty({n}, TensorOptions().with_device(kGpu));
      dropped = temp.raw_data();
      pg->allreduce(temp, dist::ReduceOp::Sum);  // the Work is dropped at once
    }
    CHECK(memory_stats(kGpu).active_bytes.current >= n * 4);  // waiting on the NCCL stream's event
    Tensor reuse = empty({n}, TensorOptions().with_device(kGpu));
    CHECK(reuse.raw_data() != dropped);
    gate.release();
    cuda::synchronize(0);
    Tensor again = empty({n}, TensorOptions().with_device(kGpu));  // the event completed: back in the pool
    CHECK(again.raw_data() == dropped);
  }

  // Errors name what was expected.
  Tensor on_cpu = ones({4});
  CHECK(testing::contains(testing::error_message([&] { pg->allreduce(on_cpu); }), "works on CUDA tensors"));
  Tensor strided = ones({4, 4}, TensorOptions().with_device(kGpu)).t();
  CHECK(testing::contains(testing::error_message([&] { pg->allreduce(strided); }), "contiguous"));
  Tensor wrong = zeros({5}, TensorOptions().with_device(kGpu));
  CHECK(testing::contains(testing::error_message([&] { pg->allgather(in, wrong); }), "must hold size()"));
}

TEST_CASE("gpu: DDP over NCCL with one rank gives the plain model's gradients on the device" *
          doctest::skip(!dist::is_backend_available("nccl"))) {
  auto make = [] {
    manual_seed(0);
    mapping::MappingOptions options;
    options.strategy = "layerwise";
    options.latent_dim = 16;
    options.seed = 3;
    options.device = kGpu;
    return std::make_unique<mapping::MappingModel>(mapping::make_target("mlp"), options);
  };
  auto model = make();
  auto reference = make();
  dist::DistributedDataParallel ddp(*model, one_rank_nccl_group(), dist::DdpOptions{.device_ids = {0}});
  CHECK(ddp.bytes_per_step() == static_cast<size_t>(model->trainable_parameter_count()) * sizeof(float));

  Tensor x = testing::random_tensor({8, 1, 28, 28}, 5).to(kGpu);
  Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}, Shape{8}).to(kGpu);
  nn::functional::cross_entropy(ddp.forward(x), y).backward();
  nn::functional::cross_entropy(reference->run(x).predictions, y).backward();
  const auto mine = model->named_latents(), theirs = reference->named_latents();
  REQUIRE(mine.size() == theirs.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    INFO(mine[i].first);
    REQUIRE(mine[i].second.grad().defined());
    CHECK(mine[i].second.grad().device() == kGpu);
    testing::check_close(mine[i].second.grad().to(kCPU), theirs[i].second.grad().to(kCPU).to_vector<float>(), 1e-6);
  }
}

#endif  // MN_WITH_CUDA
