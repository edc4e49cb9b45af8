#include "core/capture.h"

#include <cstring>
#include <map>

#include "core/allocator.h"

namespace mn::capture {

namespace detail {
thread_local MN_CONSTINIT Recording* t_recording = nullptr;
}  // namespace detail

namespace {
// The recording that was started on this thread and is not destroyed yet (recording or broken).
thread_local Recording* t_open = nullptr;
}  // namespace

struct Access {
  static Graph& graph(Recording& r) { return r.graph_; }
  static void stop(Recording& r, const std::string& reason) {
    r.reason_ = reason;
    detail::t_recording = nullptr;
    MN_CHECK(!r.throw_on_break_, RuntimeError, "cannot capture this computation: ", reason);
  }
  static std::vector<std::function<void()>>& steps(Graph& g) { return g.steps_; }
  static std::vector<Graph::Pool>& pools(Graph& g) { return g.pools_; }
  static std::vector<Graph::LeafGrad>& grads(Graph& g) { return g.grads_; }
};

namespace {

// Borrowed views of the graph's pool memory, one Storage object per block.
thread_local std::map<std::pair<void*, size_t>, std::shared_ptr<Storage>>* t_borrowed = nullptr;

bool from_pool(Graph& g, const Storage& s) {
  for (const auto& p : Access::pools(g))
    if (s.allocator() == p.allocator.get()) return true;
  return false;
}

}  // namespace

// ---- Graph ----

Graph::~Graph() {
  steps_.clear();  // the borrowed views go before the pools
  pools_.clear();
}

void Graph::replay() const {
  MN_CHECK(!detail::t_recording, RuntimeError, "capture: a graph cannot be replayed while recording another");
  for (const auto& step : steps_) step();
}

bool Graph::grads_match() const {
  for (const auto& g : grads_) {
    const std::shared_ptr<TensorImpl> leaf = g.leaf.lock();
    if (!leaf) continue;  // a destroyed leaf needs no gradient
    const Tensor current = Tensor(leaf).grad();
    if ((current.defined() ? current.storage()->data() : nullptr) != g.before) return false;
  }
  return true;
}

void Graph::attach_grads() const {
  for (const auto& g : grads_)
    if (const std::shared_ptr<TensorImpl> leaf = g.leaf.lock()) Tensor(leaf).set_grad(g.after);
}

int64_t Graph::reserved_bytes() const {
  int64_t n = 0;
  for (const auto& p : pools_) n += p.allocator->stats().reserved_bytes.current;
  return n;
}

int64_t Graph::peak_allocated_bytes() const {
  int64_t n = 0;
  for (const auto& p : pools_) n += p.allocator->stats().allocated_bytes.peak;
  return n;
}

// ---- Recording ----

Recording::Recording(Graph& graph) : graph_(graph) {
  MN_CHECK(t_open == nullptr, RuntimeError, "capture: recordings do not nest (this thread is already recording)");
  MN_CHECK(graph.steps_.empty(), ValueError, "capture: expected an empty graph, got one with ",
           graph.steps_.size(), " recorded steps");
  t_open = this;
  t_borrowed = new std::map<std::pair<void*, size_t>, std::shared_ptr<Storage>>();
  detail::t_recording = this;
}

Recording::~Recording() {
  detail::t_recording = nullptr;
  t_open = nullptr;
  delete t_borrowed;
  t_borrowed = nullptr;
}

// ---- what the engine calls while recording ----

namespace detail {

Tensor hold(const Tensor& t) {
  if (!t.defined()) return t;
  Recording* r = t_open;
  const std::shared_ptr<Storage>& s = t.storage();
  std::shared_ptr<Storage> bound = s;  // memory from outside the graph: keep it alive
  if (r != nullptr && from_pool(Access::graph(*r), *s)) {
    auto& slot = (*t_borrowed)[{s->data(), s->nbytes()}];
    if (!slot) slot = std::make_shared<Storage>(Storage::Borrowed{}, s->data(), s->nbytes(), s->device());
    bound = slot;
  }
  // A fresh handle: the graph must not keep autograd history (and what it saves) alive.
  return make_view(bound, t.sizes(), t.strides(), t.storage_offset(), t.dtype());
}

}  // namespace detail

void unsupported(const std::string& what) {
  if (Recording* r = detail::t_recording) Access::stop(*r, what);
}

void host_access() {
  unsupported("host code read or wrote a tensor's memory (Tensor::data) outside a kernel");
}

void host_wrote(const Tensor& t) {
  if (!recording()) return;
  MN_CHECK(t.device().is_cpu() && t.is_contiguous(), ValueError,
           "capture::host_wrote: expected a contiguous CPU tensor, got one on ", t.device());
  std::shared_ptr<std::vector<char>> bytes;
  {
    Pause pause;
    const char* src = static_cast<const char*>(t.raw_data());
    bytes = std::make_shared<std::vector<char>>(src, src + t.nbytes());
  }
  Tensor held = detail::hold(t);
  host_step([held, bytes] {
    if (!bytes->empty()) std::memcpy(held.raw_data(), bytes->data(), bytes->size());
  });
}

void random_fill(const Tensor& t, Distribution dist, double p1, double p2, Generator& gen, RandomFillFn fill) {
  MN_CHECK(fill != nullptr, ValueError, "capture::random_fill: expected a fill kernel, got none");
  if (!recording()) {
    Tensor out = t;
    fill(out, dist, p1, p2, gen.reserve(out.numel()));
    return;
  }
  Tensor held = detail::hold(t);
  std::weak_ptr<const void> alive = gen.lifetime();
  Generator* g = &gen;
  host_step([held, alive, g, dist, p1, p2, fill]() mutable {
    const auto token = alive.lock();
    MN_CHECK(token != nullptr, RuntimeError,
             "capture: the generator of a random tensor in this graph was destroyed after the recording; "
             "keep it alive as long as the compiled function");
    fill(held, dist, p1, p2, g->reserve(held.numel()));
  });
}

void host_step(std::function<void()> step) {
  if (!recording()) {
    step();
    return;
  }
  {
    Pause pause;
    step();
  }
  Access::steps(Access::graph(*t_open)).push_back(std::move(step));
}

void grad_written(const Tensor& leaf, const void* before) {
  if (!recording()) return;
  Recording* r = t_open;
  auto& grads = Access::grads(Access::graph(*r));
  const Tensor after = leaf.grad();
  for (auto& g : grads)
    if (g.leaf.lock() == leaf.impl_ptr()) {
      g.after = after;  // a second backward in the same recording: the first one's `before` stands
      return;
    }
  grads.push_back({leaf.impl_ptr(), before, after});
}

std::shared_ptr<DeviceAllocator> pool_for(Device device) {
  Recording* r = detail::t_recording;
  if (r == nullptr) return nullptr;
  auto& pools = Access::pools(Access::graph(*r));
  for (const auto& p : pools)
    if (p.device == device) return p.allocator;
  pools.push_back({device, make_private_allocator(device)});
  return pools.back().allocator;
}

}  // namespace mn::capture
