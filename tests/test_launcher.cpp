// dist/launcher.h (how mn-run's launchers meet and end rounds together) over in-process stores, and the
// agent-store variables of dist/env.h that tell setup_ddp the launcher serves the store. The launchers
// themselves, as processes on two "nodes", are tested in tests/dist/test_multinode.cpp (label dist).
#include <doctest/doctest.h>

#include <chrono>
#include <map>
#include <thread>

#include "dist/env.h"
#include "dist/launcher.h"
#include "dist/store.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::dist;
using namespace std::chrono_literals;
using launch::Coordinator;
using launch::Failure;
using launch::NodeConfig;
using mn::testing::contains;
using mn::testing::error_message;

namespace {

NodeConfig node(int rank, int nnodes = 2, int nproc = 1, int max_restarts = 0) {
  return NodeConfig{nnodes, rank, nproc, max_restarts};
}

auto never = []() -> std::optional<Failure> { return std::nullopt; };

// Two launchers' rendezvous of round 0, at the same time: both succeed.
void meet(Coordinator& a, Coordinator& b) {
  std::optional<Failure> from_b;
  std::thread other([&] { from_b = b.rendezvous(0, 5s, 1ms, never); });
  CHECK_FALSE(a.rendezvous(0, 5s, 1ms, never).has_value());
  other.join();
  CHECK_FALSE(from_b.has_value());
}

AgentStore agent(const std::map<std::string, std::string>& vars) {
  return parse_agent_store([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

}  // namespace

TEST_CASE("launch::Coordinator: every node joins, then each round's keys are its own") {
  auto store = std::make_shared<HashStore>(2000ms);
  Coordinator a(store, node(0)), b(store, node(1));
  meet(a, b);
  CHECK(a.missing(0).empty());
  // Round 1 starts empty: nobody has joined it, and round 0's failure does not leak into it.
  CHECK(a.publish_failure(0, Failure{1, 1, 3, true, "rank 1 on node 1 exited with code 3"}));
  CHECK(a.missing(1) == std::vector<int>{0, 1});
  CHECK_FALSE(a.failure(1).has_value());
  CHECK(a.failure(0).has_value());
}

TEST_CASE("launch::Coordinator: the rendezvous times out naming the nodes that did not arrive") {
  auto store = std::make_shared<HashStore>(2000ms);
  Coordinator a(store, node(0, 4)), c(store, node(2, 4));
  c.join(0);
  const auto start = std::chrono::steady_clock::now();
  std::optional<Failure> f = a.rendezvous(0, 100ms, 5ms, never);
  CHECK(std::chrono::steady_clock::now() - start < 2s);
  REQUIRE(f.has_value());
  CHECK_FALSE(f->restartable);
  CHECK(f->rank == -1);
  CHECK(contains(f->what, "node(s) 1, 3 of 4 did not join"));
  // Published: node 2, still waiting, gets the same failure instead of waiting for its own timeout.
  std::optional<Failure> seen = c.rendezvous(0, 10s, 5ms, never);
  REQUIRE(seen.has_value());
  CHECK(seen->what == f->what);
}

TEST_CASE("launch::Coordinator: a duplicate node rank and disagreeing settings end the rendezvous") {
  auto store = std::make_shared<HashStore>(2000ms);
  Coordinator a(store, node(0)), a_again(store, node(0));
  a.join(0);
  CHECK(contains(error_message([&] { a_again.join(0); }), "two launchers were started with --node-rank 0"));

  auto store2 = std::make_shared<HashStore>(2000ms);
  Coordinator x(store2, node(0, 2, 2)), y(store2, node(1, 2, 1, 3));
  y.join(0);
  std::optional<Failure> f = x.rendezvous(0, 5s, 1ms, never);
  REQUIRE(f.has_value());
  CHECK(f->exit_code == 2);
  CHECK(contains(f->what, "node 1 has --nnodes 2 --nproc-per-node 1 --max-restarts 3"));
  CHECK(contains(f->what, "node 0 has --nnodes 2 --nproc-per-node 2 --max-restarts 0"));
}

TEST_CASE("launch::Coordinator: the first published failure is the round's, for every node") {
  auto store = std::make_shared<HashStore>(2000ms);
  Coordinator a(store, node(0)), b(store, node(1));
  CHECK(b.publish_failure(0, Failure{1, 3, 137, true, "rank 3 on node 1 was killed by signal 9 (Killed)"}));
  CHECK_FALSE(a.publish_failure(0, Failure{0, 0, 3, true, "rank 0 on node 0 exited with code 3"}));
  for (Coordinator* c : {&a, &b}) {
    std::optional<Failure> f = c->failure(0);
    REQUIRE(f.has_value());
    CHECK(f->node == 1);
    CHECK(f->rank == 3);
    CHECK(f->exit_code == 137);
    CHECK(f->restartable);
    CHECK(f->what == "rank 3 on node 1 was killed by signal 9 (Killed)");
  }
  // The interruption a launcher reports (a signal) is published for the others, not restartable.
  auto store2 = std::make_shared<HashStore>(2000ms);
  Coordinator p(store2, node(0)), q(store2, node(1));
  std::optional<Failure> f = p.rendezvous(0, 5s, 1ms, [] {
    return std::optional<Failure>(Failure{0, -1, 143, false, "the mn-run of node 0 was stopped by signal 15"});
  });
  REQUIRE(f.has_value());
  REQUIRE(q.failure(0).has_value());
  CHECK_FALSE(q.failure(0)->restartable);
  CHECK(q.failure(0)->exit_code == 143);
}

TEST_CASE("launch::Coordinator: done and left") {
  auto store = std::make_shared<HashStore>(2000ms);
  Coordinator a(store, node(0, 3)), b(store, node(1, 3)), c(store, node(2, 3));
  for (Coordinator* n : {&a, &b, &c}) n->join(0);
  a.mark_done(0);
  b.mark_done(0);
  CHECK_FALSE(a.all_done(0));
  c.mark_done(0);
  CHECK(a.all_done(0));
  CHECK(a.not_left(0) == std::vector<int>{1, 2});
  c.mark_left(0);
  CHECK(a.not_left(0) == std::vector<int>{1});
  // A node that never joined is not waited for.
  CHECK(a.not_left(1).empty());
}

TEST_CASE("launch::Coordinator: node 0 finds the launchers whose heartbeat stopped") {
  auto store = std::make_shared<HashStore>(2000ms);
  Coordinator a(store, node(0, 3)), b(store, node(1, 3)), c(store, node(2, 3));
  b.beat(0);
  c.beat(0);
  CHECK(a.silent_nodes(0, 80ms).empty());  // the first look starts the clocks
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(25ms);
    b.beat(0);  // node 2 has gone quiet
    a.silent_nodes(0, 80ms);
  }
  CHECK(a.silent_nodes(0, 80ms) == std::vector<int>{2});
  CHECK(a.silent_nodes(1, 80ms).empty());  // a new round starts fresh
}

TEST_CASE("launch::Coordinator over a TcpStore: the launcher's own store round trips") {
  TcpStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = 5000ms;
  auto server = std::make_shared<TcpStore>(o);
  o.is_server = false;
  o.port = server->port();
  auto client = std::make_shared<TcpStore>(o);
  Coordinator a(server, node(0)), b(client, node(1));
  meet(a, b);
  CHECK(b.publish_failure(0, Failure{1, 1, 1, true, "rank 1 on node 1 exited with code 1\nwith a second line"}));
  REQUIRE(a.failure(0).has_value());
  CHECK(a.failure(0)->what == "rank 1 on node 1 exited with code 1\nwith a second line");
}

TEST_CASE("agent store variables: TORCHELASTIC_USE_AGENT_STORE and TORCHELASTIC_RESTART_COUNT") {
  CHECK_FALSE(agent({}).used);
  CHECK(agent({}).restart_count == 0);
  CHECK(agent({}).prefix() == "/worker/attempt_0");
  const AgentStore a = agent({{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}});
  CHECK(a.used);
  CHECK(a.prefix() == "/worker/attempt_2");
  CHECK_FALSE(agent({{"TORCHELASTIC_USE_AGENT_STORE", "False"}}).used);
  CHECK(agent({{"TORCHELASTIC_USE_AGENT_STORE", "1"}}).used);
  CHECK(contains(error_message([] { agent({{"TORCHELASTIC_USE_AGENT_STORE", "yes"}}); }),
                 "TORCHELASTIC_USE_AGENT_STORE='yes' is not True or False"));
  CHECK(contains(error_message([] { agent({{"TORCHELASTIC_RESTART_COUNT", "-1"}}); }),
                 "TORCHELASTIC_RESTART_COUNT='-1' is not a non-negative integer"));
}
