#pragma once
// How the launchers of one job (mn-run, one per node) work together through node 0's TcpStore, as
// torchrun's elastic agents do. Node 0's launcher serves the store for the whole job; every launcher,
// node 0's included, is a client of it. A job runs in rounds: round 0 first, round r + 1 after a rank
// failed in round r and --max-restarts allows another attempt. All keys of round r live under
// "mn-run/round<r>/", so a restarted rendezvous never sees the keys of an earlier round:
//
//   join/<node>     counter: 1 when node <node> registered (2: two launchers claim the same --node-rank)
//   node/<node>     the settings the node's launcher was started with (all must agree)
//   failures        counter of failures published in the round; the one that made it 1 wrote `failure`
//   failure         the round's first failure: node, rank, exit code, restartable, what happened
//   done/<node>     every rank of the node exited 0
//   left/<node>     the node's launcher has seen the end of the round and no longer needs the store
//   alive/<node>    counter the node's launcher raises about once a second while its ranks run; node 0's
//                   launcher ends the round when one stops rising (a launcher killed, its machine gone)
//
// Node 0's launcher waits for every other node's left/<node> (briefly) before it exits, so the others
// read the end of the job instead of losing their connection.
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/store.h"

namespace mn::dist::launch {

// What every launcher of a job must agree on (its command line).
struct NodeConfig {
  int nnodes = 1;
  int node_rank = 0;
  int nproc_per_node = 1;
  int max_restarts = 0;
};

// The event that ends a round.
struct Failure {
  int node = 0;
  int rank = -1;             // the global rank that failed; -1 when the launcher itself ended the round
  int exit_code = 1;         // what the launchers exit with when no restart follows
  bool restartable = true;   // a rank's failure is; a launcher stopped by a signal, a failed rendezvous is not
  std::string what;          // e.g. "rank 3 on node 1 exited with code 1"
};

// "1, 3"
std::string node_list(const std::vector<int>& nodes);

class Coordinator {
 public:
  Coordinator(std::shared_ptr<Store> store, NodeConfig config);

  const NodeConfig& config() const { return config_; }
  Store& store() { return *store_; }

  // Registers this node for round `round`; ValueError when another launcher already registered the same
  // node rank.
  void join(int round);
  // The node ranks that have not joined round `round` yet (in increasing order).
  std::vector<int> missing(int round);
  // Once every node joined: ValueError naming the nodes whose settings differ from this node's.
  void check_agreement(int round);

  // Joins round `round` and waits until every node has (polling every `poll`) and their settings agree.
  // Returns nullopt then, or the failure that ended the round instead: one another launcher published, or
  // one this call published: the nodes that did not arrive within `timeout`, a duplicate node rank,
  // disagreeing settings, or what `interrupted` returns (asked between polls: e.g. a signal reached the
  // launcher).
  std::optional<Failure> rendezvous(int round, Milliseconds timeout, Milliseconds poll,
                                    const std::function<std::optional<Failure>()>& interrupted);

  // Publishes a failure of round `round`; true when it is the round's first (the one every launcher reports).
  bool publish_failure(int round, const Failure& failure);
  // The round's first failure, when one was published (does not block).
  std::optional<Failure> failure(int round);

  void mark_done(int round);
  bool all_done(int round);
  void mark_left(int round);
  // The nodes other than node 0 that joined the round but have not marked left/<node>.
  std::vector<int> not_left(int round);

  // Heartbeats: beat() raises this node's alive/<node>; silent_nodes() (node 0) lists the other nodes
  // whose counter has not risen for `limit`, counted from the first call for the round.
  void beat(int round);
  std::vector<int> silent_nodes(int round, Milliseconds limit);

 private:
  std::string key(int round, const std::string& name) const;
  std::string settings_text() const;

  std::shared_ptr<Store> store_;
  NodeConfig config_;
  // silent_nodes: the round it watches, and per node the last counter seen and when it changed.
  int watched_round_ = -1;
  std::vector<std::pair<int64_t, std::chrono::steady_clock::time_point>> last_beat_;
};

}  // namespace mn::dist::launch
