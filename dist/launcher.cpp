#include "dist/launcher.h"

#include <chrono>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace mn::dist::launch {

namespace {

using Clock = std::chrono::steady_clock;

std::string encode(const Failure& f) {
  return str(f.node, " ", f.rank, " ", f.exit_code, " ", f.restartable ? 1 : 0, "\n", f.what);
}

Failure decode(const std::string& text) {
  Failure f;
  std::istringstream in(text);
  int restartable = 0;
  in >> f.node >> f.rank >> f.exit_code >> restartable;
  MN_CHECK(static_cast<bool>(in), RuntimeError, "malformed failure record in the launchers' store: '", text, "'");
  f.restartable = restartable != 0;
  in.get();  // the newline
  std::getline(in, f.what, '\0');
  return f;
}

}  // namespace

std::string node_list(const std::vector<int>& nodes) {
  std::string out;
  for (size_t i = 0; i < nodes.size(); ++i) out += (i ? ", " : "") + std::to_string(nodes[i]);
  return out;
}

Coordinator::Coordinator(std::shared_ptr<Store> store, NodeConfig config)
    : store_(std::move(store)), config_(config) {
  MN_CHECK(store_ != nullptr, ValueError, "launch::Coordinator needs a store, got null");
  MN_CHECK(config_.nnodes >= 1 && config_.node_rank >= 0 && config_.node_rank < config_.nnodes, ValueError,
           "launch::Coordinator: node rank ", config_.node_rank, " is not in [0, ", config_.nnodes, ")");
}

std::string Coordinator::key(int round, const std::string& name) const {
  return str("mn-run/round", round, "/", name);
}

std::string Coordinator::settings_text() const {
  return str("--nnodes ", config_.nnodes, " --nproc-per-node ", config_.nproc_per_node, " --max-restarts ",
             config_.max_restarts);
}

void Coordinator::join(int round) {
  const std::string me = std::to_string(config_.node_rank);
  store_->set(key(round, "node/" + me), settings_text());
  const int64_t claims = store_->add(key(round, "join/" + me), 1);
  MN_CHECK(claims == 1, ValueError, "two launchers were started with --node-rank ", config_.node_rank,
           "; give each node its own rank in [0, ", config_.nnodes, ")");
}

std::vector<int> Coordinator::missing(int round) {
  std::vector<int> out;
  for (int node = 0; node < config_.nnodes; ++node)
    if (!store_->check({key(round, "join/" + std::to_string(node))})) out.push_back(node);
  return out;
}

void Coordinator::check_agreement(int round) {
  const std::string mine = settings_text();
  std::vector<std::string> differ;
  for (int node = 0; node < config_.nnodes; ++node) {
    const std::string theirs = store_->get_string(key(round, "node/" + std::to_string(node)));
    if (theirs != mine) differ.push_back(str("node ", node, " has ", theirs));
  }
  if (differ.empty()) return;
  std::string list;
  for (size_t i = 0; i < differ.size(); ++i) list += (i ? "; " : "") + differ[i];
  throw ValueError(str("the launchers disagree: node ", config_.node_rank, " has ", mine, ", ", list,
                       "; start every node's mn-run with the same --nnodes, --nproc-per-node and --max-restarts"));
}

std::optional<Failure> Coordinator::rendezvous(int round, Milliseconds timeout, Milliseconds poll,
                                               const std::function<std::optional<Failure>()>& interrupted) {
  const auto deadline = Clock::now() + timeout;
  auto give_up = [&](Failure f) {
    if (!publish_failure(round, f)) return *failure(round);  // another launcher ended the round first
    return f;
  };
  try {
    join(round);
  } catch (const ValueError& e) {
    return give_up(Failure{config_.node_rank, -1, 2, false, e.what()});
  }
  while (true) {
    if (std::optional<Failure> f = failure(round)) return f;
    if (std::optional<Failure> stop = interrupted ? interrupted() : std::nullopt) return give_up(*stop);
    const std::vector<int> absent = missing(round);
    if (absent.empty()) break;
    if (Clock::now() >= deadline) {
      const double seconds = std::chrono::duration<double>(timeout).count();
      return give_up(Failure{config_.node_rank, -1, 1, false,
                             str("rendezvous timed out after ", seconds, " s: node(s) ", node_list(absent),
                                 " of ", config_.nnodes, " did not join (start mn-run --node-rank ",
                                 absent.front(),
                                 " there with the same --master-addr and --master-port, or raise "
                                 "--rdzv-timeout)")});
    }
    std::this_thread::sleep_for(poll);
  }
  try {
    check_agreement(round);
  } catch (const ValueError& e) {
    return give_up(Failure{config_.node_rank, -1, 2, false, e.what()});
  }
  return std::nullopt;
}

bool Coordinator::publish_failure(int round, const Failure& failure) {
  if (store_->add(key(round, "failures"), 1) != 1) return false;
  store_->set(key(round, "failure"), encode(failure));
  return true;
}

std::optional<Failure> Coordinator::failure(int round) {
  if (!store_->check({key(round, "failure")})) {
    // A publisher between its add and its set: wait for the record rather than report nothing.
    if (!store_->check({key(round, "failures")})) return std::nullopt;
    store_->wait({key(round, "failure")});
  }
  return decode(store_->get_string(key(round, "failure")));
}

void Coordinator::mark_done(int round) { store_->set(key(round, "done/" + std::to_string(config_.node_rank)), "1"); }

bool Coordinator::all_done(int round) {
  std::vector<std::string> keys;
  for (int node = 0; node < config_.nnodes; ++node) keys.push_back(key(round, "done/" + std::to_string(node)));
  return store_->check(keys);
}

void Coordinator::mark_left(int round) { store_->set(key(round, "left/" + std::to_string(config_.node_rank)), "1"); }

std::vector<int> Coordinator::not_left(int round) {
  std::vector<int> out;
  for (int node = 1; node < config_.nnodes; ++node) {
    const std::string n = std::to_string(node);
    if (store_->check({key(round, "join/" + n)}) && !store_->check({key(round, "left/" + n)})) out.push_back(node);
  }
  return out;
}

void Coordinator::beat(int round) { store_->add(key(round, "alive/" + std::to_string(config_.node_rank)), 1); }

std::vector<int> Coordinator::silent_nodes(int round, Milliseconds limit) {
  const auto now = Clock::now();
  if (watched_round_ != round) {
    watched_round_ = round;
    last_beat_.assign(static_cast<size_t>(config_.nnodes), {-1, now});
  }
  std::vector<int> out;
  for (int node = 1; node < config_.nnodes; ++node) {
    auto& [count, changed] = last_beat_[static_cast<size_t>(node)];
    const int64_t current = store_->add(key(round, "alive/" + std::to_string(node)), 0);
    if (current != count) {
      count = current;
      changed = now;
    } else if (now - changed >= limit) {
      out.push_back(node);
    }
  }
  return out;
}

}  // namespace mn::dist::launch
