#include "dist/ddp.h"

#include <cstring>
#include <mutex>
#include <optional>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "core/capture.h"
#include "core/error.h"
#include "dist/env.h"
#include "dist/store.h"

namespace mn::dist {

// ---------------------------------------------------------------------------------------------------
// Hashing

namespace {

constexpr uint64_t kFnvPrime = 0x100000001b3ull;
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;

uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: spreads the FNV state over all bits
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// FNV-1a over 8-byte words (then the tail bytes): a mismatch detector, not a cryptographic hash.
uint64_t hash_bytes(const void* data, size_t size, uint64_t h) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = (h ^ word) * kFnvPrime;
  }
  for (; i < size; ++i) h = (h ^ p[i]) * kFnvPrime;
  return h;
}

uint64_t hash_string(const std::string& s, uint64_t h) {
  const uint64_t n = s.size();
  h = hash_bytes(&n, sizeof(n), h);
  return hash_bytes(s.data(), s.size(), h);
}

uint64_t hash_shape(const Shape& shape, uint64_t h) {
  const int64_t rank = shape.size();
  h = hash_bytes(&rank, sizeof(rank), h);
  return hash_bytes(shape.data(), sizeof(int64_t) * static_cast<size_t>(shape.size()), h);
}

}  // namespace

namespace {

train::Metrics reduce_metrics(ProcessGroup& pg, Device device, const train::Metrics& local, int64_t samples) {
  MN_CHECK(samples >= 0, ValueError, "average_metrics: samples must be >= 0, got ", samples);
  std::vector<float> values;
  for (const auto& [key, value] : local) values.push_back(static_cast<float>(value * static_cast<double>(samples)));
  values.push_back(static_cast<float>(samples));
  Tensor sums = from_vector(values, Shape{static_cast<int64_t>(values.size())});
  if (pg.backend() == "nccl") sums = sums.to(device);
  pg.allreduce(sums, ReduceOp::Sum)->wait();
  const std::vector<float> total = sums.to(kCPU).to_vector<float>();
  MN_CHECK(total.size() == values.size(), RuntimeError, "average_metrics: the all-reduce returned ", total.size(),
           " values for ", values.size());
  const double all_samples = total.back();
  train::Metrics out;
  size_t i = 0;
  for (const auto& [key, value] : local) out[key] = static_cast<double>(total[i++]) / all_samples;
  return out;
}

}  // namespace

std::function<train::Metrics(const train::Metrics&, int64_t)> average_metrics(Device device, ProcessGroup* group) {
  return [device, group](const train::Metrics& local, int64_t samples) {
    if (group != nullptr) return reduce_metrics(*group, device, local, samples);
    std::shared_ptr<ProcessGroup> default_group = default_process_group();  // refuses without setup_ddp
    return reduce_metrics(*default_group, device, local, samples);
  };
}

uint64_t tensor_hash(const Tensor& tensor, uint64_t seed) {
  uint64_t h = kFnvOffset ^ mix64(seed);
  if (!tensor.defined()) return mix64(hash_string("undefined", h));
  const auto dtype = static_cast<uint8_t>(tensor.dtype());
  h = hash_bytes(&dtype, 1, h);
  h = hash_shape(tensor.sizes(), h);
  Tensor host = tensor.detach();
  if (!host.device().is_cpu()) host = host.to(kCPU);
  host = host.contiguous();
  return mix64(hash_bytes(host.raw_data(), host.nbytes(), h));
}

// ---------------------------------------------------------------------------------------------------
// The default group

namespace {

struct DefaultGroup {
  std::shared_ptr<Store> store;
  std::shared_ptr<ProcessGroup> group;
};

std::mutex g_default_mutex;
std::optional<DefaultGroup> g_default;

struct Endpoint {
  std::string host;
  uint16_t port = 0;
};

Endpoint parse_init_method(const std::string& init_method) {
  if (init_method == "env://") {
    auto variable = [](const char* name) -> std::string {
      const char* v = std::getenv(name);
      MN_CHECK(v != nullptr && *v != '\0', ValueError, "init_method env:// needs the environment variable ", name,
               ", which is not set (launch with mn-run, or set MASTER_ADDR and MASTER_PORT)");
      return v;
    };
    Endpoint e;
    e.host = variable("MASTER_ADDR");
    e.port = parse_port_variable("MASTER_PORT", variable("MASTER_PORT"));
    return e;
  }
  const std::string scheme = "tcp://";
  if (init_method.rfind(scheme, 0) == 0) {
    const std::string rest = init_method.substr(scheme.size());
    const size_t colon = rest.rfind(':');
    MN_CHECK(colon != std::string::npos && colon > 0, ValueError, "init_method '", init_method,
             "' must look like tcp://host:port");
    Endpoint e;
    e.host = rest.substr(0, colon);
    e.port = parse_port_variable("init_method port", rest.substr(colon + 1));
    return e;
  }
  throw ValueError(str("init_method '", init_method, "' is not supported; use env:// or tcp://host:port"));
}

}  // namespace

void setup_ddp(int rank, int world_size, const std::string& backend, const std::string& init_method,
               Milliseconds timeout) {
  // With other ranks, a backend this build lacks is refused only after the ranks agree on it (below),
  // so that error reaches every rank instead of stranding the others in the rendezvous.
  if (world_size == 1) check_backend(backend);
  MN_CHECK(world_size >= 1, ValueError, "setup_ddp: world_size must be at least 1, got ", world_size);
  MN_CHECK(rank >= 0 && rank < world_size, ValueError, "setup_ddp: rank must be in [0, ", world_size - 1, "], got ",
           rank);
  MN_CHECK(timeout.count() > 0, ValueError, "setup_ddp: timeout must be positive, got ", timeout.count(), " ms");
  std::lock_guard<std::mutex> lock(g_default_mutex);
  MN_CHECK(!g_default.has_value(), RuntimeError, "setup_ddp() was already called (rank ", g_default->group->rank(),
           " of ", g_default->group->size(), "); call cleanup_ddp() first");
  if (backend == "mpi") {
    // MPI connects the ranks mpirun started: no store, and init_method is not used.
    ProcessGroupOptions group_options;
    group_options.timeout = timeout;
    auto group = make_process_group(backend, nullptr, rank, world_size, group_options);
    group->barrier()->wait();
    g_default = DefaultGroup{nullptr, std::move(group)};
    return;
  }
  const Endpoint endpoint = parse_init_method(init_method);

  TcpStoreOptions store_options;
  store_options.host = endpoint.host;
  store_options.port = endpoint.port;
  store_options.is_server = rank == 0;
  store_options.timeout = timeout;
  store_options.max_connections = kDefaultStoreMaxConnections + static_cast<size_t>(world_size);  // + the ranks
  // Under mn-run (or torchrun) the launcher serves the store for the whole job (env.h, AgentStore): every
  // rank is a client, and the keys of this attempt (and of this process's n-th setup_ddp, as all ranks
  // call it equally often) live under their own prefix, away from those of earlier attempts.
  std::shared_ptr<Store> store;
  const AgentStore agent = init_method == "env://" ? agent_store_from_env() : AgentStore{};
  if (agent.used) {
    static int setups_under_agent_store = 0;  // guarded by g_default_mutex
    store_options.is_server = false;
    const int setup = setups_under_agent_store++;
    store = std::make_shared<PrefixStore>(setup == 0 ? agent.prefix() : str(agent.prefix(), "/setup_", setup),
                                          std::make_shared<TcpStore>(store_options));
  } else {
    store = std::make_shared<TcpStore>(store_options);
  }
  check_world_size(*store, rank, world_size, timeout);
  // ---- backend agreement (issue 20 section 4): every rank, before any backend's rendezvous ----
  check_backend_agreement(*store, rank, world_size, backend, timeout);
  check_backend(backend);

  ProcessGroupOptions group_options;
  group_options.timeout = timeout;
  group_options.master_addr = endpoint.host;
  group_options.device_index = rank;
  if (const char* local = std::getenv("LOCAL_RANK"); local != nullptr && *local != '\0')
    group_options.device_index = static_cast<int>(parse_int_variable("LOCAL_RANK", local));
  auto group = make_process_group(backend, store, rank, world_size, group_options);
  // Return only when every rank has joined: afterwards rank 0 may drop the store without stranding anyone.
  group->barrier()->wait();
  g_default = DefaultGroup{std::move(store), std::move(group)};
}

void cleanup_ddp() {
  std::optional<DefaultGroup> leaving;
  {
    std::lock_guard<std::mutex> lock(g_default_mutex);
    leaving.swap(g_default);
  }
  if (!leaving) return;
  leaving->group.reset();  // joins the worker; closes the transport
  leaving->store.reset();  // rank 0: stops the server (unless the launcher serves it)
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return g_default.has_value();
}

bool is_available() { return !available_backends().empty(); }  // false without Gloo and NCCL

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  MN_CHECK(g_default.has_value(), RuntimeError,
           "Process group is not initialized. Call setup_ddp() before wrap_ddp().");
  return g_default->group;
}

std::shared_ptr<Store> default_store() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  MN_CHECK(g_default.has_value(), RuntimeError, "Process group is not initialized. Call setup_ddp() first.");
  MN_CHECK(g_default->store != nullptr, RuntimeError, "the ", g_default->group->backend(),
           " backend has no store (MPI connects the ranks itself)");
  return g_default->store;
}

int get_rank() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return g_default ? g_default->group->rank() : 0;
}

int get_world_size() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  return g_default ? g_default->group->size() : 1;
}

// ---------------------------------------------------------------------------------------------------
// Reducer

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  Reducer(const nn::NamedTensors& params, std::shared_ptr<ProcessGroup> group, const DdpOptions& options)
      : group_(std::move(group)) {
    for (const auto& [name, param] : params) {
      names_.push_back(name);
      params_.push_back(param);
    }
    assign_buckets(options);
  }

  // Registered after construction (hooks hold a weak reference, so a destroyed wrapper leaves only no-ops).
  void register_hooks() {
    std::weak_ptr<Reducer> weak = weak_from_this();
    for (size_t i = 0; i < params_.size(); ++i)
      params_[i].register_post_accumulate_grad_hook([weak, i](const Tensor& leaf) {
        if (auto reducer = weak.lock()) reducer->on_gradient(i, leaf);
      });
  }

  // Before a forward through the wrapper: the parameters must still be the module's, and a backward
  // interrupted by an error must not leave half a reduction behind.
  void prepare_for_forward(const nn::NamedTensors& module_params) {
    MN_CHECK(module_params.size() == params_.size(), RuntimeError, "the module now has ", module_params.size(),
             " parameters that require grad but was wrapped with ", params_.size(), "; wrap it again after changing it");
    for (size_t i = 0; i < params_.size(); ++i)
      MN_CHECK(module_params[i].second.same(params_[i]), RuntimeError, "parameter '", names_[i],
               "' was replaced after wrap_ddp (did module.to() run after wrapping?); move the module first, then wrap");
    if (in_backward_) abandon_backward();
  }

  bool sync_enabled = true;

  size_t bytes_per_step() const {
    size_t bytes = 0;
    for (const Bucket& b : buckets_) bytes += b.contents.nbytes();
    return bytes;
  }

  std::vector<std::vector<std::string>> bucket_names() const {
    std::vector<std::vector<std::string>> out;
    for (const Bucket& b : buckets_) {
      out.emplace_back();
      for (size_t index : b.params) out.back().push_back(names_[index]);
    }
    return out;
  }

  std::vector<Tensor> parameters() const { return params_; }
  int64_t allreduce_count() const { return allreduce_count_; }
  ProcessGroup& group() const { return *group_; }

 private:
  struct Bucket {
    Tensor contents;             // flat f32 on the parameters' device
    std::vector<size_t> params;  // parameter indices in slot order
    size_t pending = 0;
    WorkPtr work;
  };
  struct Slot {
    size_t bucket;
    int64_t offset;
  };

  void assign_buckets(const DdpOptions& options) {
    MN_CHECK(!params_.empty(), ValueError,
             "DistributedDataParallel: the module has no parameters that require grad, nothing to synchronise");
    const Device device = params_.front().device();
    slots_.resize(params_.size());
    Bucket current;
    size_t current_bytes = 0;
    auto close = [&] {
      current.contents = zeros({static_cast<int64_t>(current_bytes / sizeof(float))}, TensorOptions(device));
      buckets_.push_back(std::move(current));
      current = Bucket{};
      current_bytes = 0;
    };
    for (size_t k = params_.size(); k-- > 0;) {  // reverse: the last parameters' grads arrive first
      const Tensor& p = params_[k];
      MN_CHECK(p.dtype() == DType::f32, TypeError, "parameter '", names_[k], "' is ", dtype_name(p.dtype()),
               "; DDP reduces f32 parameters");
      slots_[k] = Slot{buckets_.size(), static_cast<int64_t>(current_bytes / sizeof(float))};
      current.params.push_back(k);
      current_bytes += p.nbytes();
      const size_t limit = buckets_.empty() ? options.first_bucket_bytes : options.bucket_bytes;
      if (current_bytes >= limit) close();
    }
    if (!current.params.empty()) close();
    for (Bucket& b : buckets_) b.pending = b.params.size();
    arrived_.assign(params_.size(), false);
  }

  Tensor slot_view(size_t index) const {
    const Slot& s = slots_[index];
    return buckets_[s.bucket].contents.narrow(0, s.offset, params_[index].numel());
  }

  // grad / world into the parameter's slot (zeros when it has no grad at all).
  void fill_slot(size_t index) {
    autograd::NoGradGuard no_grad;
    Tensor slot = slot_view(index);
    Tensor grad = params_[index].grad();
    if (!grad.defined()) {
      slot.zero_();
      return;
    }
    slot.copy_(mul(grad.detach(), 1.0 / static_cast<double>(group_->size())).reshape({slot.numel()}));
  }

  void on_gradient(size_t index, const Tensor&) {
    if (!sync_enabled) return;  // no_sync: the engine keeps accumulating into .grad
    // An earlier backward that failed before its end (its queued callback was dropped unrun): start over.
    // (A module run directly, e.g. MappingModel::run, never passes through prepare_for_forward.)
    if (in_backward_ && end_callback_.expired()) abandon_backward();
    if (!in_backward_) {
      MN_CHECK(autograd::backward_in_progress(), RuntimeError,
               "DDP gradient hook ran outside a backward pass (internal error)");
      in_backward_ = true;
      auto alive = std::make_shared<char>(0);  // lives as long as the queued callback
      end_callback_ = alive;
      std::weak_ptr<Reducer> weak = weak_from_this();
      autograd::queue_callback([weak, alive] {
        if (auto reducer = weak.lock()) reducer->finish_backward();
      });
    }
    MN_CHECK(!arrived_[index], RuntimeError, "parameter '", names_[index],
             "' received its gradient twice in one backward pass (internal error)");
    arrived_[index] = true;
    fill_slot(index);
    Bucket& bucket = buckets_[slots_[index].bucket];
    if (--bucket.pending == 0) launch_ready_buckets();
  }

  // Starts every ready bucket whose predecessors have all started: the same order on every rank.
  void launch_ready_buckets() {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
      Bucket& bucket = buckets_[next_bucket_++];
      ++allreduce_count_;
      if (capture::recording()) {
        // Inside a compiled step (nn/compile.h) the all-reduce becomes one of the graph's steps, run to
        // completion where it stands: every rank replays the same collectives in the same order.
        std::shared_ptr<ProcessGroup> group = group_;
        Tensor contents = bucket.contents;
        capture::host_step([group, contents] { group->allreduce(contents, ReduceOp::Sum)->wait(); });
        continue;
      }
      bucket.work = group_->allreduce(bucket.contents, ReduceOp::Sum);
    }
  }

  // End of backward: parameters without a gradient this time contribute their current .grad (or zeros),
  // every bucket is reduced and the averages become the parameters' .grad.
  void finish_backward() {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (arrived_[i]) continue;
      arrived_[i] = true;
      fill_slot(i);
      --buckets_[slots_[i].bucket].pending;
    }
    launch_ready_buckets();
    std::string error;
    for (Bucket& bucket : buckets_) {
      try {
        if (bucket.work) bucket.work->wait();
      } catch (const std::exception& e) {
        if (error.empty()) error = e.what();
      }
    }
    if (error.empty()) {
      autograd::NoGradGuard no_grad;
      for (size_t i = 0; i < params_.size(); ++i)
        params_[i].set_grad(slot_view(i).reshape(params_[i].sizes()).clone());
    }
    reset();
    MN_CHECK(error.empty(), RuntimeError, "DDP gradient all-reduce failed: ", error);
  }

  void abandon_backward() {
    // Collectives already started must finish before their buckets are reused; their errors surface on
    // the next collective anyway, since the group is then broken.
    for (Bucket& bucket : buckets_) {
      try {
        if (bucket.work) bucket.work->wait();
      } catch (const std::exception&) {
      }
    }
    reset();
  }

  void reset() {
    for (Bucket& b : buckets_) {
      b.pending = b.params.size();
      b.work.reset();
    }
    arrived_.assign(params_.size(), false);
    next_bucket_ = 0;
    in_backward_ = false;
    end_callback_.reset();
  }

  std::shared_ptr<ProcessGroup> group_;
  std::vector<std::string> names_;
  std::vector<Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<Slot> slots_;
  std::vector<bool> arrived_;
  size_t next_bucket_ = 0;
  bool in_backward_ = false;
  std::weak_ptr<char> end_callback_;  // expires when this backward's end callback is gone
  int64_t allreduce_count_ = 0;
};

// ---------------------------------------------------------------------------------------------------
// Construction checks

namespace {

// The parameters DDP reduces: those that require grad, in listing order.
nn::NamedTensors reduced_parameters(const nn::Module& module) {
  nn::NamedTensors out;
  for (const auto& [name, p] : module.named_parameters())
    if (p.requires_grad()) out.emplace_back(name, p);
  return out;
}

// Every parameter and buffer, for the broadcast from rank 0.
std::vector<Tensor> module_state(const nn::Module& module) {
  std::vector<Tensor> out;
  for (const auto& [name, p] : module.named_parameters()) out.push_back(p);
  for (const auto& [name, b] : module.named_buffers()) out.push_back(b);
  return out;
}

// The state that is compared, not sent: every submodule's replica_state() groups, with the submodule's
// path in the description.
nn::NamedTensorGroups replica_groups(const nn::Module& module) {
  nn::NamedTensorGroups out;
  for (const auto& [prefix, m] : module.named_modules())
    for (auto& [description, tensors] : m->replica_state())
      out.emplace_back(prefix.empty() ? description : str(description, " (in module '", prefix, "')"),
                       std::move(tensors));
  return out;
}

// Entry 0: the layout (names, shapes, dtypes; requires_grad for parameters); entry 1 + g: group g of the
// replica state.
std::vector<int64_t> module_fingerprint(const nn::Module& module, const nn::NamedTensorGroups& replica) {
  std::vector<int64_t> out;
  uint64_t layout = kFnvOffset;
  auto add = [&](const std::string& name, const Tensor& t, uint64_t flag) {
    layout = hash_string(name, layout);
    layout = hash_shape(t.sizes(), layout);
    const uint64_t words[2] = {static_cast<uint64_t>(t.dtype()), flag};
    layout = hash_bytes(words, sizeof(words), layout);
  };
  for (const auto& [name, p] : module.named_parameters()) add(name, p, p.requires_grad() ? 1 : 0);
  for (const auto& [name, b] : module.named_buffers()) add(name, b, 2);
  out.push_back(static_cast<int64_t>(mix64(layout)));
  for (const auto& [description, tensors] : replica) {
    uint64_t h = hash_string(description, kFnvOffset);
    for (const Tensor& t : tensors) h = tensor_hash(t, h);
    out.push_back(static_cast<int64_t>(h));
  }
  return out;
}

// NCCL only moves CUDA memory: the small construction-time exchanges then go through the module's device.
std::vector<int64_t> allgather_values(ProcessGroup& group, const std::vector<int64_t>& mine, Device device) {
  Tensor input = from_vector(mine, Shape{static_cast<int64_t>(mine.size())}).to(device);
  Tensor output =
      zeros({static_cast<int64_t>(mine.size()) * group.size()}, TensorOptions(DType::i64).with_device(device));
  group.allgather(input, output)->wait();
  return output.to(kCPU).to_vector<int64_t>();
}

void check_same_module_everywhere(const nn::Module& module, Device module_device, ProcessGroup& group,
                                  bool check_replica_state) {
  const Device device = group.backend() == "nccl" ? module_device : kCPU;
  const nn::NamedTensorGroups replica = replica_groups(module);
  const std::vector<int64_t> mine = module_fingerprint(module, replica);
  const std::vector<int64_t> counts = allgather_values(group, {static_cast<int64_t>(mine.size())}, device);
  for (int r = 1; r < group.size(); ++r)
    MN_CHECK(counts[r] == counts[0], RuntimeError, "DDP: rank ", r, " has a module with ", counts[r] - 1,
             " replica-state groups but rank 0 has ", counts[0] - 1, "; build the same module on every rank");
  const std::vector<int64_t> all = allgather_values(group, mine, device);
  const size_t n = mine.size();
  for (int r = 1; r < group.size(); ++r) {
    const int64_t* theirs = all.data() + static_cast<size_t>(r) * n;
    MN_CHECK(theirs[0] == all[0], RuntimeError, "DDP: rank ", r,
             " has different parameter or buffer names, shapes or dtypes than rank 0; build the same module on "
             "every rank");
    if (!check_replica_state) continue;
    for (size_t g = 1; g < n; ++g)
      MN_CHECK(theirs[g] == all[g], RuntimeError, "DDP: ", replica[g - 1].first, " differ between rank 0 and rank ",
               r, " (hash ", static_cast<uint64_t>(all[g]), " vs ", static_cast<uint64_t>(theirs[g]),
               "); build the module the same way (same seeds, same initialisation) on every rank");
  }
}

// Rank 0's parameters and buffers become everyone's (one coalesced broadcast per dtype).
void broadcast_state(const std::vector<Tensor>& state, ProcessGroup& group) {
  autograd::NoGradGuard no_grad;
  for (DType dtype : {DType::f32, DType::i64}) {
    std::vector<Tensor> tensors, flat;
    for (const Tensor& t : state)
      if (t.dtype() == dtype && t.numel() > 0) {
        tensors.push_back(t);
        flat.push_back(t.detach().reshape({t.numel()}));
      }
    if (tensors.empty()) continue;
    Tensor coalesced = cat(flat, 0).contiguous();
    group.broadcast(coalesced, 0)->wait();
    int64_t offset = 0;
    for (const Tensor& t : tensors) {
      t.detach().copy_(coalesced.narrow(0, offset, t.numel()).reshape(t.sizes()));
      offset += t.numel();
    }
  }
}

// The device every parameter and buffer is on (kCPU for a module without tensors).
Device module_device(const nn::Module& module) {
  std::optional<std::pair<std::string, Device>> first;
  auto check = [&](const std::string& name, const Tensor& t) {
    if (!first) {
      first.emplace(name, t.device());
      return;
    }
    MN_CHECK(t.device() == first->second, DeviceError, "'", name, "' is on ", t.device(), " but '", first->first,
             "' is on ", first->second, "; DDP needs the whole module on one device");
  };
  for (const auto& [name, p] : module.named_parameters()) check(name, p);
  for (const auto& [name, b] : module.named_buffers()) check(name, b);
  return first ? first->second : kCPU;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// DistributedDataParallel

DistributedDataParallel::DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> group,
                                                 DdpOptions options)
    : module_(&module), device_(module_device(module)) {
  MN_CHECK(group != nullptr, RuntimeError, "Process group is not initialized. Call setup_ddp() before wrap_ddp().");
  MN_CHECK(options.first_bucket_bytes > 0 && options.bucket_bytes > 0, ValueError,
           "DDP bucket sizes must be positive, got ", options.first_bucket_bytes, " and ", options.bucket_bytes);
  const bool wants_cuda = group->backend() == "nccl";
  MN_CHECK(device_.is_cuda() == wants_cuda, DeviceError, "the module is on ", device_, " but the process group's ",
           group->backend(), " backend works on ", wants_cuda ? "CUDA" : "CPU", " tensors; use ",
           wants_cuda ? "gloo for a CPU module" : "nccl for a CUDA module", " or move the module");
  if (device_.is_cpu()) {
    MN_CHECK(options.device_ids.empty(), ValueError, "device_ids must be empty for a CPU model, got ",
             options.device_ids.size(), " id(s) starting with ",
             options.device_ids.empty() ? 0 : options.device_ids[0]);
  } else {
    MN_CHECK(
        options.device_ids.empty() || (options.device_ids.size() == 1 && options.device_ids[0] == device_.index),
        ValueError, "device_ids must be empty or [", device_.index, "] for a model on ", device_);
  }
  const nn::NamedTensors reduced = reduced_parameters(module);
  MN_CHECK(!reduced.empty(), ValueError,
           "DistributedDataParallel: the ", module.type_name(), " has no parameters that require grad, nothing to "
           "synchronise");
  check_same_module_everywhere(module, device_, *group, options.check_buffers);
  broadcast_state(module_state(module), *group);
  reducer_ = std::make_shared<Reducer>(reduced, std::move(group), options);
  reducer_->register_hooks();
}

DistributedDataParallel::~DistributedDataParallel() = default;
DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&&) noexcept = default;

Tensor DistributedDataParallel::forward(const Tensor& input) {
  reducer_->prepare_for_forward(reduced_parameters(*module_));
  return module_->forward(input);
}

std::vector<Tensor> DistributedDataParallel::parameters() const { return reducer_->parameters(); }

DistributedDataParallel::NoSyncGuard::NoSyncGuard(std::shared_ptr<Reducer> reducer)
    : reducer_(std::move(reducer)), previous_(reducer_->sync_enabled) {
  reducer_->sync_enabled = false;
}

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() { reducer_->sync_enabled = previous_; }

DistributedDataParallel::NoSyncGuard DistributedDataParallel::no_sync() { return NoSyncGuard(reducer_); }

void DistributedDataParallel::set_gradient_sync(bool enabled) { reducer_->sync_enabled = enabled; }

bool DistributedDataParallel::gradient_sync() const { return reducer_->sync_enabled; }

train::Metrics DistributedDataParallel::average_metrics(const train::Metrics& metrics, int64_t samples) {
  return reduce_metrics(reducer_->group(), device_, metrics, samples);
}

int DistributedDataParallel::rank() const { return reducer_->group().rank(); }

int DistributedDataParallel::world_size() const { return reducer_->group().size(); }

std::vector<std::vector<double>> DistributedDataParallel::all_gather(const std::vector<double>& values) {
  ProcessGroup& group = reducer_->group();
  std::vector<int64_t> bits(values.size());
  if (!values.empty()) std::memcpy(bits.data(), values.data(), values.size() * sizeof(double));
  const std::vector<int64_t> all =
      allgather_values(group, bits, group.backend() == "nccl" ? device_ : kCPU);
  std::vector<std::vector<double>> out(static_cast<size_t>(group.size()), std::vector<double>(values.size()));
  for (size_t r = 0; r < out.size(); ++r)
    if (!values.empty()) std::memcpy(out[r].data(), all.data() + r * values.size(), values.size() * sizeof(double));
  return out;
}

size_t DistributedDataParallel::bytes_per_step() const { return reducer_->bytes_per_step(); }

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_parameter_names() const {
  return reducer_->bucket_names();
}

int64_t DistributedDataParallel::allreduce_count() const { return reducer_->allreduce_count(); }

ProcessGroup& DistributedDataParallel::process_group() const { return reducer_->group(); }

DistributedDataParallel wrap_ddp(nn::Module& module, const std::vector<int>& device_ids) {
  DdpOptions options;
  options.device_ids = device_ids;
  return DistributedDataParallel(module, default_process_group(), options);
}

}  // namespace mn::dist
