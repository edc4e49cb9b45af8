// dist/ pieces that need no second process: environment parsing, DistributedSampler, the stores (TcpStore
// server and clients in one process), Gloo collectives with threads as ranks, backend errors, and the
// single-process setup_ddp / wrap_ddp paths. Multi-process runs live in tests/dist (label dist).
#ifdef MN_WITH_GLOO

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <thread>

#include "dist/ddp.h"
#include "dist/env.h"
#include "dist/gloo_process_group.h"
#include "dist/sampler.h"
#include "dist/socket.h"
#include "dist/store.h"
#include "mapping/mapping_model.h"
#include "nn/data/dataloader.h"
#include "nn/layers.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::dist;
using namespace std::chrono_literals;
using mn::testing::contains;
using mn::testing::error_message;

namespace {

EnvConfig parse(const std::map<std::string, std::string>& vars) {
  return parse_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::map<std::string, std::string> good_env() {
  return {{"RANK", "1"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29555"}};
}

// A store server on a free port, for tests that need several clients.
std::unique_ptr<TcpStore> server_store(Milliseconds timeout = 5000ms) {
  TcpStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = timeout;
  return std::make_unique<TcpStore>(o);
}

std::unique_ptr<TcpStore> client_store(uint16_t port, Milliseconds timeout = 5000ms) {
  TcpStoreOptions o;
  o.port = port;
  o.timeout = timeout;
  return std::make_unique<TcpStore>(o);
}

// Runs body(rank) on `world` threads, each with its own Gloo group over one shared store.
void with_gloo_threads(int world, const std::function<void(ProcessGroup&)>& body) {
  auto server = std::shared_ptr<TcpStore>(server_store().release());
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank)
    threads.emplace_back([&, rank] {
      try {
        std::shared_ptr<Store> store = rank == 0 ? std::static_pointer_cast<Store>(server)
                                                 : std::shared_ptr<Store>(client_store(server->port()).release());
        ProcessGroupOptions options;
        options.timeout = 20000ms;
        GlooProcessGroup group(store, rank, world, options);
        body(group);
        group.barrier()->wait();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(rank)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    CHECK(errors[static_cast<size_t>(rank)] == "");
  }
}

std::shared_ptr<nn::Sequential> small_target() {
  manual_seed(7);
  auto net = std::make_shared<nn::Sequential>();
  net->push_back(std::make_shared<nn::Linear>(4, 3));
  net->push_back(std::make_shared<nn::ReLU>());
  net->push_back(std::make_shared<nn::Linear>(3, 2));
  return net;
}

mapping::MappingModel small_model() {
  mapping::MappingOptions o;
  o.latent_dim = 5;
  o.seed = 11;
  return mapping::MappingModel(small_target(), o);
}

}  // namespace

TEST_CASE("dist env: from_env reads the launcher's variables and names bad ones") {
  EnvConfig c = parse(good_env());
  CHECK(c.rank == 1);
  CHECK(c.world_size == 3);
  CHECK(c.local_rank == 1);  // defaults to RANK
  CHECK(c.local_world_size == 3);
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.master_port == 29555);

  auto env = good_env();
  env["LOCAL_RANK"] = "0";
  env["LOCAL_WORLD_SIZE"] = "2";
  c = parse(env);
  CHECK(c.local_rank == 0);
  CHECK(c.local_world_size == 2);

  auto with = [](const std::string& name, const std::optional<std::string>& value) {
    auto e = good_env();
    if (value)
      e[name] = *value;
    else
      e.erase(name);
    return error_message([&] { parse(e); });
  };
  CHECK(with("WORLD_SIZE", "abc") ==
        std::string("environment variable WORLD_SIZE='abc' is not a positive integer"));
  CHECK(with("WORLD_SIZE", "0") == std::string("environment variable WORLD_SIZE='0' is not a positive integer"));
  CHECK(contains(with("RANK", std::nullopt), "environment variable RANK is not set"));
  CHECK(contains(with("RANK", "-1"), "RANK='-1' is not a non-negative integer"));
  CHECK(contains(with("RANK", "3"), "RANK=3 must be less than WORLD_SIZE=3"));
  CHECK(contains(with("RANK", " 1"), "RANK=' 1'"));
  CHECK(contains(with("MASTER_ADDR", std::nullopt), "MASTER_ADDR is not set"));
  CHECK(contains(with("MASTER_ADDR", ""), "MASTER_ADDR is empty"));
  CHECK(contains(with("MASTER_PORT", "70000"), "MASTER_PORT='70000' is not a port number (1-65535)"));
  CHECK(contains(with("MASTER_PORT", "http"), "MASTER_PORT='http' is not a port number"));
  CHECK(contains(with("LOCAL_RANK", "x"), "LOCAL_RANK='x' is not a non-negative integer"));
  CHECK_THROWS_AS(parse({}), ValueError);

  // The real environment.
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("MASTER_ADDR", "localhost", 1);
  setenv("MASTER_PORT", "1234", 1);
  unsetenv("LOCAL_RANK");
  c = from_env();
  CHECK(c.world_size == 1);
  CHECK(c.master_addr == "localhost");
  setenv("WORLD_SIZE", "two", 1);
  CHECK(error_message([] { from_env(); }) ==
        std::string("environment variable WORLD_SIZE='two' is not a positive integer"));
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) unsetenv(name);
}

TEST_CASE("dist sampler: one permutation, disjoint equal shards, PyTorch padding and drop_last") {
  for (bool drop_last : {false, true})
    for (int64_t n : {0, 1, 7, 10, 12}) {
      const int64_t replicas = 3;
      std::vector<int64_t> all;
      std::multiset<int64_t> seen;
      for (int64_t r = 0; r < replicas; ++r) {
        DistributedSampler s(n, replicas, r, true, 5, drop_last);
        s.set_epoch(2);
        auto mine = s.indices();
        CHECK(static_cast<int64_t>(mine.size()) == s.size());
        CHECK(s.size() == (drop_last ? n / replicas : (n + replicas - 1) / replicas));
        for (int64_t i : mine) {
          CHECK(i >= 0);
          CHECK(i < n);
          seen.insert(i);
        }
        all.insert(all.end(), mine.begin(), mine.end());
      }
      // Rebuild the padded/cut order and compare with the shards interleaved.
      auto order = data::shuffled_indices(n, 5, 2);
      const int64_t total = drop_last ? n / replicas * replicas : (n + replicas - 1) / replicas * replicas;
      for (int64_t i = 0; static_cast<int64_t>(order.size()) < total; ++i) order.push_back(order[i]);
      order.resize(static_cast<size_t>(total));
      std::vector<int64_t> interleaved;
      const int64_t per = total / replicas;
      for (int64_t k = 0; k < per; ++k)
        for (int64_t r = 0; r < replicas; ++r) interleaved.push_back(all[static_cast<size_t>(r * per + k)]);
      CHECK(interleaved == order);
      if (!drop_last) CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == static_cast<size_t>(n));
      if (drop_last) CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == seen.size());  // disjoint
    }

  // Padding that exceeds the data set wraps around repeatedly.
  DistributedSampler tiny(2, 5, 4, false);
  CHECK(tiny.indices() == std::vector<int64_t>{0});
  CHECK(DistributedSampler(2, 5, 2, false).indices() == std::vector<int64_t>{0});
  CHECK(DistributedSampler(2, 5, 3, false).indices() == std::vector<int64_t>{1});

  // No shuffle: strided ranges; set_epoch changes only shuffled orders.
  DistributedSampler plain(10, 2, 1, false);
  CHECK(plain.indices() == std::vector<int64_t>{1, 3, 5, 7, 9});
  DistributedSampler shuffled(100, 2, 0, true, 1);
  auto epoch0 = shuffled.indices();
  shuffled.set_epoch(1);
  CHECK(shuffled.indices() != epoch0);
  shuffled.set_epoch(0);
  CHECK(shuffled.indices() == epoch0);
  CHECK(shuffled.index_tensor().dtype() == DType::i64);
  CHECK(shuffled.index_tensor().numel() == 50);

  CHECK(error_message([] { DistributedSampler(10, 2, 2); }) ==
        std::string("DistributedSampler: invalid rank 2, rank should be in the interval [0, 1]"));
  CHECK_THROWS_AS(DistributedSampler(10, 0, 0), ValueError);
  CHECK_THROWS_AS(DistributedSampler(-1, 2, 0), ValueError);
}

TEST_CASE("dist sampler: a DataLoader over each rank's sampler visits that rank's shard, epoch by epoch") {
  // The scaling guide's loop: DataLoader(dataset, sampler=...), sampler.set_epoch(epoch) before each epoch.
  const int64_t n = 11, replicas = 2;
  std::vector<float> values(static_cast<size_t>(n));
  std::iota(values.begin(), values.end(), 0.0f);
  const Tensor inputs = from_vector(values, {n, 1});
  const Tensor targets = arange(n);
  std::vector<std::shared_ptr<DistributedSampler>> samplers;
  std::vector<data::DataLoader> loaders;
  for (int64_t r = 0; r < replicas; ++r) {
    samplers.push_back(std::make_shared<DistributedSampler>(n, replicas, r, true, 9));
    loaders.emplace_back(inputs, targets, data::DataLoaderOptions{.batch_size = 4, .sampler = samplers.back()});
  }
  for (uint64_t epoch : {0u, 1u, 5u}) {
    std::multiset<int64_t> seen;
    for (int64_t r = 0; r < replicas; ++r) {
      samplers[static_cast<size_t>(r)]->set_epoch(epoch);
      const data::DataLoader& loader = loaders[static_cast<size_t>(r)];
      CHECK(loader.size() == 2);  // 6 samples per rank: batches of 4 and 2
      std::vector<int64_t> visited;
      for (const data::Batch& b : loader) {
        const std::vector<int64_t> t = b.targets.to_vector<int64_t>();
        const std::vector<float> x = b.inputs.to_vector<float>();
        for (size_t k = 0; k < t.size(); ++k) CHECK(x[k] == static_cast<float>(t[k]));
        visited.insert(visited.end(), t.begin(), t.end());
      }
      CHECK(visited == samplers[static_cast<size_t>(r)]->indices());
      seen.insert(visited.begin(), visited.end());
    }
    // Together the ranks cover the data set; one sample is repeated to pad 11 to 12.
    CHECK(seen.size() == 12);
    CHECK(std::set<int64_t>(seen.begin(), seen.end()).size() == static_cast<size_t>(n));
  }
  CHECK(loaders[0].order().to_vector<int64_t>() != (std::vector<int64_t>{0, 2, 4, 6, 8, 10}));
}

TEST_CASE("dist store: HashStore and PrefixStore semantics") {
  auto hash = std::make_shared<HashStore>(200ms);
  hash->set("a", std::string("1"));
  CHECK(hash->get_string("a") == "1");
  CHECK(hash->add("n", 2) == 2);
  CHECK(hash->add("n", -5) == -3);
  CHECK(hash->get_string("n") == "-3");
  CHECK(hash->check({"a", "n"}));
  CHECK_FALSE(hash->check({"a", "missing"}));
  CHECK(hash->add("a", 1) == 2);  // "1" is decimal text, hence a counter
  hash->set("text", std::string("x"));
  CHECK_THROWS_AS(hash->add("text", 1), ValueError);
  const std::string timeout = error_message([&] { hash->get("missing"); });
  CHECK(contains(timeout, "'missing'"));
  CHECK(contains(timeout, "0.2 s"));
  CHECK(hash->delete_key("a"));
  CHECK_FALSE(hash->delete_key("a"));

  std::thread late([&] {
    std::this_thread::sleep_for(50ms);
    hash->set("late", std::string("here"));
  });
  hash->wait({"late"}, 5000ms);
  late.join();

  PrefixStore prefixed("group1", hash);
  prefixed.set("k", std::string("v"));
  CHECK(hash->get_string("group1/k") == "v");
  CHECK(prefixed.get_string("k") == "v");
  CHECK(prefixed.add("c", 4) == 4);
  CHECK(prefixed.check({"k", "c"}));
  CHECK_THROWS_AS(PrefixStore("p", nullptr), ValueError);
}

TEST_CASE("dist rendezvous: ranks started with different WORLD_SIZEs get one clear error naming them") {
  // Agreeing ranks pass.
  {
    HashStore store(2000ms);
    std::vector<std::thread> ranks;
    std::atomic<int> failures{0};
    for (int r = 0; r < 3; ++r)
      ranks.emplace_back([&, r] {
        try {
          check_world_size(store, r, 3, 2000ms);
        } catch (const Error&) {
          ++failures;
        }
      });
    for (auto& t : ranks) t.join();
    CHECK(failures == 0);
  }
  // Rank 0 was told 2, rank 1 was told 4 (the ranks 2 and 3 it expects never come): both fail at once,
  // each naming both sizes, instead of Gloo's "enforce fail at address.cc" or a timeout.
  HashStore store(2000ms);
  std::string rank0, rank1;
  std::thread other([&] { rank1 = error_message([&] { check_world_size(store, 1, 4, 2000ms); }); });
  rank0 = error_message([&] { check_world_size(store, 0, 2, 2000ms); });
  other.join();
  CHECK(contains(rank0, "disagree on WORLD_SIZE: rank 0 has 2, rank 1 has 4"));
  CHECK(contains(rank1, "rank 1 has 4 but rank 0 has 2"));
}

TEST_CASE("dist store: TcpStore server and clients in one process") {
  auto server = server_store(3000ms);
  REQUIRE(server->is_server());
  REQUIRE(server->port() != 0);
  auto client = client_store(server->port(), 3000ms);

  server->set("hello", std::string("world"));
  CHECK(client->get_string("hello") == "world");
  Bytes binary{0, 1, 2, 255, 0, 7};
  client->set("binary", binary);
  CHECK(server->get("binary") == binary);
  client->set("empty", Bytes{});
  CHECK(server->get("empty").empty());
  CHECK(client->check({"hello", "binary"}));
  CHECK_FALSE(client->check({"hello", "nope"}));
  CHECK(client->delete_key("hello"));
  CHECK_FALSE(server->check({"hello"}));

  // get blocks until another client sets the key.
  std::thread writer([&] {
    auto other = client_store(server->port());
    std::this_thread::sleep_for(100ms);
    other->set("later", std::string("done"));
  });
  const auto start = std::chrono::steady_clock::now();
  CHECK(client->get_string("later") == "done");
  CHECK(std::chrono::steady_clock::now() - start >= 50ms);
  writer.join();

  // add is atomic across connections.
  std::vector<std::thread> adders;
  for (int t = 0; t < 4; ++t)
    adders.emplace_back([&] {
      auto c = client_store(server->port());
      for (int i = 0; i < 50; ++i) c->add("counter", 1);
    });
  for (auto& t : adders) t.join();
  CHECK(server->add("counter", 0) == 200);
  CHECK(client->get_string("counter") == "200");

  // Timeouts end waits and name the key and the time.
  const auto before = std::chrono::steady_clock::now();
  const std::string message = error_message([&] { client->wait({"never", "hello2"}, 300ms); });
  CHECK(std::chrono::steady_clock::now() - before < 3000ms);
  CHECK(contains(message, "timed out after 0.3 s"));
  CHECK(contains(message, "'never'"));
  client->set_timeout(200ms);
  CHECK(contains(error_message([&] { client->get("absent"); }), "'absent'"));
  client->set_timeout(3000ms);
  CHECK(client->get_string("binary").size() == binary.size());  // the connection is still usable

  // PrefixStore over a TcpStore.
  auto shared = std::shared_ptr<Store>(client_store(server->port()).release());
  PrefixStore ns("job", shared);
  ns.set("x", std::string("1"));
  CHECK(server->get_string("job/x") == "1");
}

TEST_CASE("dist store: connection failures are bounded and clear") {
  // Nobody listens: the retry loop gives up at the deadline.
  uint16_t port = 0;
  { net::Socket probe = net::listen_on("127.0.0.1", 0, &port); }  // a port that was just free
  const auto start = std::chrono::steady_clock::now();
  const std::string refused = error_message([&] { client_store(port, 400ms); });
  CHECK(std::chrono::steady_clock::now() - start < 5000ms);
  CHECK(contains(refused, "could not connect to the store at 127.0.0.1:"));
  CHECK(contains(refused, "MASTER_ADDR/MASTER_PORT"));

  // Something else listens and never answers the handshake.
  uint16_t silent_port = 0;
  net::Socket silent = net::listen_on("127.0.0.1", 0, &silent_port);
  const std::string no_handshake = error_message([&] { client_store(silent_port, 300ms); });
  CHECK(contains(no_handshake, "is another service listening on MASTER_PORT?"));

  // Two servers cannot share a port.
  auto first = server_store();
  TcpStoreOptions o;
  o.port = first->port();
  o.is_server = true;
  CHECK(contains(error_message([&] { TcpStore second(o); }), "cannot listen"));

  // The server goes away while a client waits: the client fails instead of waiting out its timeout.
  auto client = client_store(first->port(), 20000ms);
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    first.reset();
  });
  const auto wait_start = std::chrono::steady_clock::now();
  const std::string closed = error_message([&] { client->get("never"); });
  stopper.join();
  CHECK(std::chrono::steady_clock::now() - wait_start < 10000ms);
  CHECK(contains(closed, "closed the connection"));
  CHECK(contains(error_message([&] { client->set("k", std::string("v")); }), "lost by an earlier failure"));
}

TEST_CASE("dist gloo: collectives with threads as ranks") {
  for (int world : {2, 3})
    with_gloo_threads(world, [](ProcessGroup& pg) {
      const int rank = pg.rank(), world = pg.size();
      CHECK(pg.backend() == "gloo");
      for (int64_t n : {0, 1, 1023}) {
        Tensor t = full({n}, rank + 1.0);
        auto work = pg.allreduce(t);
        work->wait();
        CHECK(work->is_completed());
        for (float v : t.to_vector<float>()) CHECK(v == doctest::Approx(world * (world + 1) / 2.0));
        Tensor a = full({n}, 2.0 * rank);
        pg.allreduce(a, ReduceOp::Avg)->wait();
        for (float v : a.to_vector<float>()) CHECK(v == doctest::Approx(world - 1.0));
      }
      Tensor ints = from_vector(std::vector<int64_t>{rank, 10 * rank + 1});
      pg.allreduce(ints)->wait();
      int64_t ranks_sum = world * (world - 1) / 2;
      CHECK(ints.to_vector<int64_t>() == std::vector<int64_t>{ranks_sum, 10 * ranks_sum + world});
      CHECK_THROWS_AS(pg.allreduce(ints, ReduceOp::Avg), TypeError);

      Tensor b = full({5}, rank == 1 ? 42.0 : -1.0);
      pg.broadcast(b, 1)->wait();
      for (float v : b.to_vector<float>()) CHECK(v == 42.0f);

      Tensor in = full({3}, static_cast<double>(rank));
      Tensor out = zeros({3 * world});
      pg.allgather(in, out)->wait();
      auto gathered = out.to_vector<float>();
      for (int r = 0; r < world; ++r)
        for (int k = 0; k < 3; ++k) CHECK(gathered[static_cast<size_t>(3 * r + k)] == static_cast<float>(r));
      CHECK_THROWS_AS(pg.allgather(in, zeros({4})), ValueError);
      CHECK_THROWS_AS(pg.broadcast(b, world), ValueError);
      CHECK_THROWS_AS(pg.allreduce(zeros({4, 4}).t()), ValueError);  // not contiguous

      // Several collectives in flight complete in issue order.
      std::vector<Tensor> ts;
      std::vector<WorkPtr> works;
      for (int k = 0; k < 8; ++k) {
        ts.push_back(full({257}, static_cast<double>(k)));
        works.push_back(pg.allreduce(ts.back()));
      }
      for (int k = 0; k < 8; ++k) {
        works[static_cast<size_t>(k)]->wait();
        CHECK(ts[static_cast<size_t>(k)].to_vector<float>()[256] == static_cast<float>(k * world));
      }
      pg.barrier()->wait();
    });
}

TEST_CASE("dist ddp: average_metrics gives every rank the means over all ranks' samples") {
  for (int world : {2, 3})
    with_gloo_threads(world, [](ProcessGroup& pg) {
      const int rank = pg.rank(), world = pg.size();
      // Rank r averaged r + 1 samples with accuracy r / 4 and loss 2r; with unequal shares the answer
      // is the sample-weighted mean, not the mean of the ranks' means.
      const int64_t samples = rank + 1;
      const train::Metrics local{{"train_accuracy", rank / 4.0}, {"train_loss", 2.0 * rank}};
      const train::Metrics all = average_metrics(kCPU, &pg)(local, samples);
      double total = 0, acc = 0, loss = 0;
      for (int r = 0; r < world; ++r) {
        total += r + 1;
        acc += (r + 1) * (r / 4.0);
        loss += (r + 1) * (2.0 * r);
      }
      REQUIRE(all.size() == 2);
      CHECK(all.at("train_accuracy") == doctest::Approx(acc / total));
      CHECK(all.at("train_loss") == doctest::Approx(loss / total));
    });
  // Without a group argument it needs setup_ddp.
  CHECK_THROWS_AS(average_metrics(kCPU)(train::Metrics{{"x", 1.0}}, 1), RuntimeError);
}

TEST_CASE("dist backends: unavailable and unknown names") {
  CHECK(error_message([] { check_backend("ucc"); }) ==
        std::string("backend 'ucc' is not available in this build; use gloo or nccl"));
  if (!is_backend_available("mpi"))  // a build without MPI says how to get it
    CHECK(contains(error_message([] { check_backend("mpi"); }),
                   "backend 'mpi' is not available in this build (built without MPI: install Open MPI"));
  CHECK(contains(error_message([] { check_backend("bogus"); }), "unknown backend 'bogus'"));
  CHECK(is_backend_available("gloo"));
#ifndef MN_WITH_CUDA
  CHECK(contains(error_message([] { check_backend("nccl"); }), "built without CUDA"));
#endif
  CHECK(is_available());
  CHECK(contains(error_message([] { setup_ddp(0, 1, "ucc"); }), "backend 'ucc' is not available in this build"));
  CHECK_FALSE(is_initialized());
}

TEST_CASE("dist ddp: wrap before setup, cleanup when uninitialised, single-process run") {
  cleanup_ddp();  // no-op
  CHECK_FALSE(is_initialized());
  mapping::MappingModel model = small_model();
  CHECK(error_message([&] { wrap_ddp(model); }) ==
        std::string("Process group is not initialized. Call setup_ddp() before wrap_ddp()."));
  CHECK(get_world_size() == 1);

  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  CHECK(contains(error_message([] { setup_ddp(0, 1); }), "MASTER_ADDR"));
  CHECK(contains(error_message([] { setup_ddp(0, 1, "gloo", "file:///tmp/x"); }), "not supported"));
  CHECK(contains(error_message([] { setup_ddp(1, 1); }), "rank must be in [0, 0]"));

  uint16_t port = 0;
  { net::Socket probe = net::listen_on("127.0.0.1", 0, &port); }
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setup_ddp(0, 1, "gloo", "env://", 20000ms);
  CHECK(is_initialized());
  CHECK(contains(error_message([] { setup_ddp(0, 1); }), "already called"));
  {
    mapping::MappingModel reference = small_model();
    auto ddp = wrap_ddp(model);
    CHECK(&ddp.module() == &model);
    CHECK(ddp.parameters().size() == model.named_latents().size());
    for (size_t i = 0; i < ddp.parameters().size(); ++i) CHECK(ddp.parameters()[i].same(model.named_latents()[i].second));
    CHECK(ddp.bytes_per_step() == static_cast<size_t>(model.trainable_parameter_count()) * sizeof(float));
    CHECK(ddp.bucket_parameter_names().size() == 1);
    CHECK(ddp.bucket_parameter_names()[0].front() == "latents." + model.named_latents().back().first);  // reverse order
    CHECK(contains(error_message([&] { wrap_ddp(model, {0}); }), "device_ids must be empty for a CPU model"));
    const size_t buffers_before = model.generator().buffers().size();

    Tensor x = mn::testing::random_param({6, 4}, 3).detach();
    // Two forwards (clean and perturbed) before one backward: each hook fires once.
    auto clean = model.run(x);
    mapping::LatentOverrides perturbed;
    for (auto& [name, z] : model.named_latents()) perturbed[name] = add(z, 0.01);
    auto noisy = model.run(x, perturbed);
    CHECK(clean.predictions.sizes() == Shape{6, 2});
    add(mean(square(clean.predictions)), mean(square(noisy.predictions))).backward();

    auto ref_clean = reference.run(x);
    mapping::LatentOverrides ref_perturbed;
    for (auto& [name, z] : reference.named_latents()) ref_perturbed[name] = add(z, 0.01);
    auto ref_noisy = reference.run(x, ref_perturbed);
    add(mean(square(ref_clean.predictions)), mean(square(ref_noisy.predictions))).backward();
    auto mine = model.named_latents();
    auto theirs = reference.named_latents();
    for (size_t i = 0; i < mine.size(); ++i) {
      REQUIRE(mine[i].second.grad().defined());
      mn::testing::check_close(mine[i].second.grad(), theirs[i].second.grad().to_vector<float>(), 1e-6);
    }
    CHECK(model.generator().buffers().size() == buffers_before);

    // no_sync: local accumulation, then one reduction of the sum.
    model.zero_grad();
    {
      auto guard = ddp.no_sync();
      mean(square(ddp.forward(x))).backward();
    }
    mean(square(ddp.forward(x))).backward();
    reference.zero_grad();
    mean(square(reference.run(x).predictions)).backward();
    mean(square(reference.run(x).predictions)).backward();
    mine = model.named_latents();
    theirs = reference.named_latents();
    for (size_t i = 0; i < mine.size(); ++i)
      mn::testing::check_close(mine[i].second.grad(), theirs[i].second.grad().to_vector<float>(), 1e-6);

    // Small buckets: one latent each, all still reduced.
    DdpOptions tiny;
    tiny.first_bucket_bytes = 4;
    tiny.bucket_bytes = 4;
    DistributedDataParallel split(model, default_process_group(), tiny);
    CHECK(split.bucket_parameter_names().size() == model.named_latents().size());
  }
  {
    // A plain module, through the trainer-facing interface (nn/train/data_parallel.h).
    auto net = small_target();
    auto ddp = wrap_ddp(*net);
    train::DataParallel& dp = ddp;
    CHECK(dp.rank() == 0);
    CHECK(dp.world_size() == 1);
    CHECK(dp.gradient_sync());
    CHECK(ddp.bytes_per_step() == static_cast<size_t>(net->parameter_count()) * sizeof(float));
    CHECK(ddp.bucket_parameter_names().at(0).front() == net->named_parameters().back().first);
    Tensor x = mn::testing::random_param({6, 4}, 5).detach();
    const int64_t before = ddp.allreduce_count();
    dp.set_gradient_sync(false);
    CHECK_FALSE(dp.gradient_sync());
    mean(square(ddp.forward(x))).backward();
    CHECK(ddp.allreduce_count() == before);  // local accumulation only
    dp.set_gradient_sync(true);
    mean(square(ddp(x))).backward();
    CHECK(ddp.allreduce_count() == before + 1);  // one bucket
    // A backward that fails after some hooks ran (a throwing hook on the input) leaves no half reduction
    // behind, also when the next forward does not go through the wrapper (as MappingModel::run does not).
    Tensor failing = x.clone().requires_grad_(true);
    failing.register_post_accumulate_grad_hook([](const Tensor&) { throw ValueError("hook stops backward"); });
    CHECK_THROWS_WITH_AS(mean(square(net->forward(failing))).backward(), "hook stops backward", ValueError);
    net->zero_grad();
    mean(square(net->forward(x))).backward();
    auto reference = small_target();
    mean(square(reference->forward(x))).backward();
    for (size_t i = 0; i < reference->parameters().size(); ++i)
      mn::testing::check_close(net->parameters()[i].grad(), reference->parameters()[i].grad().to_vector<float>(), 1e-6);
    const train::Metrics m = dp.average_metrics({{"loss", 2.5}, {"accuracy", 0.75}}, 4);
    CHECK(m == train::Metrics{{"loss", 2.5}, {"accuracy", 0.75}});
    CHECK(contains(error_message([&] { dp.average_metrics({{"loss", 1.0}}, -1); }), "samples must be >= 0"));
    // A module without trainable parameters has nothing to reduce.
    net->requires_grad_(false);
    CHECK(contains(error_message([&] { wrap_ddp(*net); }), "Sequential has no parameters that require grad"));
  }
  cleanup_ddp();
  CHECK_FALSE(is_initialized());
  cleanup_ddp();
}

TEST_CASE("dist ddp: tensor_hash sees every byte, the dtype and the shape") {
  Tensor a = arange(0.0, 100.0, 1.0, DType::f32);
  Tensor b = a.clone();
  CHECK(tensor_hash(a) == tensor_hash(b));
  b.narrow(0, 57, 1).fill_(57.5);
  CHECK(tensor_hash(a) != tensor_hash(b));
  CHECK(tensor_hash(a) != tensor_hash(a.reshape({10, 10})));
  CHECK(tensor_hash(a) != tensor_hash(a, 1));
  CHECK(tensor_hash(a.reshape({10, 10}).t()) == tensor_hash(a.reshape({10, 10}).t().contiguous()));
}

#endif  // MN_WITH_GLOO
