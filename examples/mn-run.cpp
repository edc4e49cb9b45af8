// mn-run: starts the ranks of one job, like torchrun: K ranks on this machine, on each of N nodes.
//
//   mn-run --nproc-per-node 4 [--master-port 29500] ./train --epochs 3                 (one node)
//   mn-run --nnodes 2 --node-rank R --master-addr node0 --master-port 29500 --nproc-per-node 4 ./train
//
// Options come first; the first argument that is not an option (or everything after `--`) is the program
// and its arguments. Each rank gets torchrun's environment: RANK (= node rank * K + local rank), LOCAL_RANK,
// WORLD_SIZE (N * K), LOCAL_WORLD_SIZE (K), GROUP_RANK (the node rank), GROUP_WORLD_SIZE (N), MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_USE_AGENT_STORE=True:
// node 0's mn-run serves the job's TcpStore at MASTER_ADDR:MASTER_PORT (a free port when --master-port is 0
// or absent on one node; every interface when the job spans nodes) and the ranks connect to it as clients
// (setup_ddp, see dist/env.h). The launchers meet in that store (dist/launcher.h) before starting ranks: a
// node that does not arrive within --rdzv-timeout seconds is named in every launcher's error.
//
// SIGINT/SIGTERM/SIGHUP sent to mn-run are forwarded to every rank. When a rank fails (non-zero exit or a
// signal) anywhere, every launcher gives its ranks SIGTERM and, after a grace period, SIGKILL; with
// --max-restarts R it then starts them all again (up to R times; TORCHELASTIC_RESTART_COUNT tells the
// program, which resumes from its own checkpoint), otherwise every mn-run exits non-zero naming the
// node, rank and exit status that failed first. Each child runs in its own process group and receives
// SIGTERM should mn-run itself die, so no rank outlives the launcher.
// Unless OMP_NUM_THREADS is set, each of K > 1 ranks gets cores / K OpenMP threads (torchrun sets 1), so
// the ranks do not oversubscribe the machine; "cores" are the CPUs mn-run may run on (its affinity mask),
// or the whole CPUs of its cgroup's CPU limit where those are fewer (core/cpu_load.h).
// --bind-cores pins local rank r to its own block of cores / K of those CPUs (r-th block, in CPU order)
// before it starts: ranks then neither migrate nor share a core, which keeps the synchronised steps of data
// parallel training in lock step on a machine the ranks fill (leftover CPUs stay unused).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cli_checks.h"
#include "core/cpu_load.h"
#include "dist/launcher.h"
#include "dist/store.h"
#include "run/processes.h"

namespace {

using Clock = std::chrono::steady_clock;
using mn::dist::launch::Failure;
using namespace mn::examples::run;

// Bounds each call a launcher makes to node 0's store once connected: a node 0 that stops answering is
// noticed within this time.
constexpr std::chrono::milliseconds kStoreCallTimeout{10'000};
// How often a launcher looks for failures published by the others (and for the end of the job).
constexpr std::chrono::milliseconds kWatchInterval{100};
// How often a launcher raises its heartbeat (nodes other than 0) or checks the others' (node 0).
constexpr std::chrono::milliseconds kHeartbeatInterval{1000};
// How long node 0's launcher stays up at the end for the others to read the outcome.
constexpr std::chrono::milliseconds kLingerTimeout{10'000};

struct Options {
  int nproc = 1;
  int nnodes = 1;
  int node_rank = 0;
  int master_port = 0;
  int max_restarts = 0;
  std::string master_addr = "127.0.0.1";
  double grace_seconds = 5.0;
  double rdzv_timeout = 300.0;
  bool bind_cores = false;
  std::string job_token_file;  // set: MN_JOB_TOKEN_FILE for the store's clients, server and ranks
  std::vector<std::string> command;
};

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }



// CLI11's usage line with the program operand, which is split off before CLI11 parses the options.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* app, std::string name) const override {
    std::string usage = CLI::Formatter::make_usage(app, std::move(name));
    usage.insert(usage.find_last_not_of('\n') + 1, " PROGRAM [ARGS]");
    return usage;
  }
};

// Parses mn-run's options strictly: they end at `--` or at the first argument that is neither an option
// nor an option's value; that argument and the rest are the program and its arguments. Returns an exit
// code when mn-run should stop (help, version, an error).
std::optional<int> parse_options(int argc, char** argv, Options& o) {
  CLI::App app{"Starts the ranks of a program on this node (torchrun's RANK, WORLD_SIZE, MASTER_ADDR, ... set)",
               "mn-run"};
  app.formatter(std::make_shared<UsageFormatter>());
  mn::examples::add_version_flag(app, "mn-run");
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc, "Number of ranks to start on this node")
      ->check(mn::examples::whole_number_in_range(1, 1024));
  app.add_option("--nnodes", o.nnodes, "Number of nodes (one mn-run each)")
      ->check(mn::examples::whole_number_in_range(1, 4096));
  app.add_option("--node-rank,--node_rank", o.node_rank, "This node's rank in [0, nnodes)")
      ->check(mn::examples::whole_number_in_range(0, 4095));
  app.add_option("--master-addr,--master_addr", o.master_addr,
                 "Address of node 0, whose mn-run serves the store (one node: this machine)");
  app.add_option("--master-port,--master_port", o.master_port,
                 "Port of node 0's store (0: pick a free one; only on one node)")
      ->check(mn::examples::whole_number_in_range(0, 65535));
  app.add_option("--rdzv-timeout,--rdzv_timeout", o.rdzv_timeout,
                 "Seconds to wait for every node's mn-run to arrive (at the start and at each restart)")
      ->check(mn::examples::finite_number_in_range(0.001, 86400));
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "Restart all ranks (on every node) up to this many times after a rank fails")
      ->check(mn::examples::whole_number_in_range(0, 1000000));
  app.add_option("--grace-period", o.grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(mn::examples::finite_number_in_range(0, 3600));
  app.add_flag("--bind-cores", o.bind_cores,
               "Pin each rank to its own block of (available CPUs / N) CPUs; OpenMP threads default to the block");
  app.add_option("--job-token-file,--job_token_file", o.job_token_file,
                 "File holding the job's secret (mode 600): the store admits only clients that prove it "
                 "(MN_JOB_TOKEN_FILE is set to it for this launcher and the ranks)");
  app.footer("Examples:\n  mn-run --nproc-per-node 2 mn-train --backend gloo --epochs 3\n"
             "  mn-run --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --nproc-per-node 4 "
             "mn-train --backend gloo");
  int split = 1;
  while (split < argc) {
    const std::string arg = argv[split];
    if (arg == "--" || arg.size() < 2 || arg[0] != '-') break;
    const CLI::Option* opt = app.get_option_no_throw(arg.substr(0, arg.find('=')));
    const bool takes_value = opt != nullptr && opt->get_items_expected_max() > 0 && arg.find('=') == std::string::npos;
    split += takes_value ? 2 : 1;  // an unknown option stays in, for CLI11 to reject
  }
  split = std::min(split, argc);
  std::vector<std::string> own;
  for (int i = split - 1; i >= 1; --i) own.push_back(argv[i]);  // CLI11 takes them reversed
  try {
    app.parse(own);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  for (int i = split; i < argc; ++i) o.command.push_back(argv[i]);
  if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
  if (o.command.empty()) {
    std::fprintf(stderr, "mn-run: expected a program to run after the options (%s)\n",
                 "usage: mn-run [OPTIONS] PROGRAM [ARGS], e.g. mn-run --nproc-per-node 2 ./train");
    return 2;
  }
  if (o.node_rank >= o.nnodes) {
    std::fprintf(stderr, "mn-run: --node-rank %d is not in [0, %d) (--nnodes %d)\n", o.node_rank, o.nnodes, o.nnodes);
    return 2;
  }
  if (!o.job_token_file.empty()) {
    // The store (launcher's and ranks') reads the token from the environment (dist/job_token.h), which the
    // ranks inherit. Both variables set is an error there; say so here, before anything starts.
    if (const char* token = std::getenv("MN_JOB_TOKEN"); token != nullptr) {
      std::fprintf(stderr, "mn-run: --job-token-file is given and MN_JOB_TOKEN is set: use one of them\n");
      return 2;
    }
    ::setenv("MN_JOB_TOKEN_FILE", o.job_token_file.c_str(), 1);
  }
  if (o.nnodes > 1 && o.master_port == 0) {
    std::fprintf(stderr, "mn-run: --nnodes %d needs --master-port: every node must know node 0's port\n", o.nnodes);
    return 2;
  }
  return std::nullopt;
}

// How a round of ranks ended on this node.
struct RoundEnd {
  Failure failure;                // the job's first failure (kind == Failed)
  bool failed = false;            // false: every rank of every node exited 0
  int signal = 0;                 // a signal stopped this launcher
  Clock::time_point seen;         // when this launcher learnt of the failure (a local rank's death: its reaping)
  Clock::time_point stopped;      // when the last local rank was gone
};

class Job {
 public:
  Job(Options options, const sigset_t& handled, const sigset_t& original)
      : o_(std::move(options)), handled_(handled), original_(original) {}

  int run();

 private:
  std::optional<int> open_store();
  std::optional<int> plan_ranks();
  bool start_ranks(int round);
  RoundEnd supervise(int round);
  void linger(int round);
  std::string rank_name(int rank) const {
    return o_.nnodes == 1 ? "rank " + std::to_string(rank)
                          : "rank " + std::to_string(rank) + " on node " + std::to_string(rank / o_.nproc);
  }
  std::string node_name() const { return o_.nnodes == 1 ? "this node" : "node " + std::to_string(o_.node_rank); }
  // What a signal to this launcher makes of the round: the other nodes stop too, and nobody restarts.
  Failure stopped_by(int sig) const {
    return Failure{o_.node_rank, -1, 128 + sig, false,
                   mn::str(o_.nnodes == 1 ? std::string("mn-run") : "the mn-run of " + node_name(),
                           " was stopped by signal ", sig, " (", strsignal(sig), ")")};
  }
  // SIGINT, SIGTERM or SIGHUP when one reached mn-run, else 0; waits up to `wait` (a SIGCHLD ends it early).
  int next_signal(std::chrono::milliseconds wait) {
    timespec pause{static_cast<time_t>(wait.count() / 1000), static_cast<long>(wait.count() % 1000) * 1'000'000L};
    siginfo_t info;
    const int sig = sigtimedwait(&handled_, &info, &pause);
    return sig == SIGINT || sig == SIGTERM || sig == SIGHUP ? sig : 0;
  }

  Options o_;
  sigset_t handled_, original_;
  std::shared_ptr<mn::dist::TcpStore> store_;
  std::optional<mn::dist::launch::Coordinator> coordinator_;
  Env common_;
  std::vector<std::vector<int>> rank_cpus_;
  std::vector<Child> children_;
  int pending_signal_ = 0;  // received while waiting outside supervise()
  std::vector<int> gone_;   // nodes whose launcher stopped answering
};

// Node 0 serves the store (and is its first client); the others connect, retrying until the rendezvous
// timeout, while still answering signals.
std::optional<int> Job::open_store() {
  mn::dist::TcpStoreOptions so;
  so.host = o_.master_addr;
  so.port = static_cast<uint16_t>(o_.master_port);
  so.timeout = kStoreCallTimeout;
  if (o_.node_rank == 0) {
    so.is_server = true;
    // Every rank and every other node's launcher holds a connection.
    so.max_connections = mn::dist::kDefaultStoreMaxConnections + static_cast<size_t>(o_.nnodes) * (o_.nproc + 1);
    if (o_.nnodes > 1) so.listen_host = "0.0.0.0";  // the other nodes reach it by MASTER_ADDR from outside
    try {
      store_ = std::make_shared<mn::dist::TcpStore>(so);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "mn-run: node 0 cannot serve the store: %s\n", e.what());
      return 1;
    }
    o_.master_port = store_->port();
    return std::nullopt;
  }
  const auto deadline = Clock::now() + std::chrono::duration<double>(o_.rdzv_timeout);
  std::string last_error;
  while (Clock::now() < deadline) {
    if (const int sig = next_signal(std::chrono::milliseconds(0))) {
      std::fprintf(stderr, "mn-run: stopped by signal %d (%s) while connecting to node 0\n", sig, strsignal(sig));
      return 128 + sig;
    }
    so.timeout = std::chrono::milliseconds(1000);
    try {
      store_ = std::make_shared<mn::dist::TcpStore>(so);
      store_->set_timeout(kStoreCallTimeout);
      return std::nullopt;
    } catch (const std::exception& e) {
      last_error = e.what();
    }
  }
  std::fprintf(stderr,
               "mn-run: rendezvous timed out after %g s: node 0 (the store at %s:%d) did not answer; start mn-run "
               "--node-rank 0 there, or check --master-addr/--master-port (last error: %s)\n",
               o_.rdzv_timeout, o_.master_addr.c_str(), o_.master_port, last_error.c_str());
  return 1;
}

// The environment and CPUs every round's ranks get.
std::optional<int> Job::plan_ranks() {
  const int world = o_.nnodes * o_.nproc;
  common_ = {
      {"WORLD_SIZE", std::to_string(world)},
      {"LOCAL_WORLD_SIZE", std::to_string(o_.nproc)},
      {"GROUP_RANK", std::to_string(o_.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(o_.nnodes)},
      {"MASTER_ADDR", o_.master_addr},
      {"MASTER_PORT", std::to_string(o_.master_port)},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts)},
  };
  const std::vector<int> cpus = allowed_cpus();
  const size_t per_rank = std::max<size_t>(1, cpus.size() / static_cast<size_t>(o_.nproc));
  // The ranks share the launcher's cgroup, so a CPU limit (a container's --cpus) is split between them
  // too: per rank its whole CPUs / K, at least 1, where that is fewer than the CPUs per rank.
  const int quota = mn::cpu_load::quota_cpus(mn::cpu_load::cgroup_cpu_limit());
  const size_t threads_per_rank =
      quota > 0 ? std::max<size_t>(1, std::min(per_rank, static_cast<size_t>(quota) / static_cast<size_t>(o_.nproc)))
                : per_rank;
  if (o_.bind_cores && cpus.size() < static_cast<size_t>(o_.nproc)) {
    std::fprintf(stderr, "mn-run: --bind-cores needs at least one CPU per rank: %d ranks, %zu CPU(s) available (%s)\n",
                 o_.nproc, cpus.size(), cpu_list_text(cpus).c_str());
    return 2;
  }
  // N ranks each starting one OpenMP thread per core would oversubscribe the machine (torchrun sets 1).
  if ((o_.nproc > 1 || o_.bind_cores) && std::getenv("OMP_NUM_THREADS") == nullptr)
    common_.push_back({"OMP_NUM_THREADS", std::to_string(threads_per_rank)});
  rank_cpus_.assign(static_cast<size_t>(o_.nproc), {});
  if (o_.bind_cores) {
    std::string plan;
    for (size_t r = 0; r < rank_cpus_.size(); ++r) {
      rank_cpus_[r].assign(cpus.begin() + static_cast<std::ptrdiff_t>(r * per_rank),
                           cpus.begin() + static_cast<std::ptrdiff_t>((r + 1) * per_rank));
      plan += (r ? ", " : "") + std::to_string(r) + ": " + cpu_list_text(rank_cpus_[r]);
    }
    std::fprintf(stderr, "mn-run: binding %d rank(s) to %zu CPU(s) each (%s)\n", o_.nproc, per_rank, plan.c_str());
  }
  return std::nullopt;
}

bool Job::start_ranks(int round) {
  const pid_t launcher = getpid();
  children_.assign(static_cast<size_t>(o_.nproc), Child{});
  for (int local = 0; local < o_.nproc; ++local) {
    const int rank = o_.node_rank * o_.nproc + local;
    Env env = common_;
    env.push_back({"RANK", std::to_string(rank)});
    env.push_back({"LOCAL_RANK", std::to_string(local)});
    env.push_back({"TORCHELASTIC_RESTART_COUNT", std::to_string(round)});
    const ExecPlan plan = plan_exec(o_.command, env, rank_cpus_[static_cast<size_t>(local)]);
    const pid_t pid = fork();
    if (pid == 0) exec_rank(plan, launcher, original_);
    if (pid < 0) {
      std::fprintf(stderr, "mn-run: fork for rank %d failed: %s\n", rank, std::strerror(errno));
      signal_all(children_, SIGKILL);
      while (wait(nullptr) > 0) {
      }
      return false;
    }
    setpgid(pid, pid);  // also here, so a signal sent right away already reaches the child's group
    children_[static_cast<size_t>(local)] = Child{rank, pid, true, 0};
  }
  return true;
}

// Watches this node's ranks and the other nodes' launchers until the round ends: every rank everywhere
// exited 0, a rank failed somewhere, a signal reached this launcher, or node 0's store went away. On a
// failure the local ranks get SIGTERM, then SIGKILL after the grace period; it returns once they are gone.
RoundEnd Job::supervise(int round) {
  mn::dist::launch::Coordinator& coordinator = *coordinator_;
  RoundEnd end;
  // A dead rank's peers often notice its closed sockets and exit before the kernel reports the death
  // itself, so failures are collected for a short while and a rank killed by a signal is named as the
  // cause ahead of ranks that merely exited with an error. Across nodes the peers may sit on another node:
  // a node whose ranks only exited with errors waits one more such while (watching the store) before it
  // publishes, so another node's killed rank is named as the job's failure rather than its consequences.
  const auto settle = std::chrono::milliseconds(250);
  std::vector<size_t> failures;
  std::optional<Clock::time_point> settle_until;
  Clock::time_point first_death{};
  bool have_end = false, stopping = false, killed = false, done_marked = false;
  Clock::time_point kill_deadline{}, next_watch = Clock::now(), next_beat = Clock::now();
  const auto grace = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.grace_seconds));
  size_t running = children_.size();

  auto begin_stop = [&](int sig) {
    if (!stopping) kill_deadline = Clock::now() + grace;
    stopping = true;
    signal_all(children_, sig);
  };
  auto end_with = [&](const Failure& f, Clock::time_point seen) {
    have_end = true;
    end.failed = true;
    end.failure = f;
    end.seen = seen;
    const bool last_round = !f.restartable || round >= o_.max_restarts;
    if (last_round && o_.node_rank != 0) try {
        coordinator.mark_left(round);  // node 0 may go as soon as every node has seen the end
      } catch (const std::exception&) {
      }
  };
  // Runs a store call; a broken connection to node 0 ends the round (unless it has ended already).
  auto store_call = [&](const auto& call) {
    try {
      call();
    } catch (const std::exception& e) {
      if (have_end) return;
      end_with(Failure{0, -1, 1, false,
                       mn::str("lost the connection to node 0's store at ", o_.master_addr, ":", o_.master_port,
                               " (", e.what(), ")")},
               Clock::now());
      std::fprintf(stderr, "mn-run: %s; stopping %s's %zu running rank(s)\n", end.failure.what.c_str(),
                   node_name().c_str(), running);
      begin_stop(SIGTERM);
    }
  };

  while (true) {
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (size_t i = 0; i < children_.size(); ++i) {
        Child& c = children_[i];
        if (c.pid != pid || !c.running) continue;
        c.running = false;
        c.status = status;
        --running;
        if (failed(status) && !stopping) {
          failures.push_back(i);
          if (!settle_until) {
            settle_until = Clock::now() + settle;
            first_death = Clock::now();
          }
        }
      }
    }
    const bool any_killed = std::any_of(failures.begin(), failures.end(),
                                        [&](size_t i) { return WIFSIGNALED(children_[i].status); });
    const auto publish_at = settle_until ? *settle_until + (o_.nnodes > 1 && !any_killed ? settle : Clock::duration{})
                                         : Clock::time_point{};
    if (settle_until && !have_end && (Clock::now() >= publish_at || (running == 0 && o_.nnodes == 1))) {
      size_t first = failures.front();
      for (size_t i : failures)
        if (WIFSIGNALED(children_[i].status)) {
          first = i;
          break;
        }
      const Child& c = children_[first];
      Failure mine{o_.node_rank, c.rank, std::max(1, exit_code_of(c.status)), true,
                   rank_name(c.rank) + " " + describe_status(c.status)};
      if (running > 0)
        std::fprintf(stderr, "mn-run: %s (pid %d) %s; stopping the other %zu rank(s)\n", rank_name(c.rank).c_str(),
                     c.pid, describe_status(c.status).c_str(), running);
      else
        std::fprintf(stderr, "mn-run: %s (pid %d) %s\n", rank_name(c.rank).c_str(), c.pid,
                     describe_status(c.status).c_str());
      Failure job = mine;
      store_call([&] {
        if (!coordinator.publish_failure(round, mine)) job = *coordinator.failure(round);  // another node was first
      });
      if (!have_end) end_with(job, first_death);
      begin_stop(SIGTERM);
    }
    const bool watch = Clock::now() >= next_watch;
    if (watch) next_watch = Clock::now() + kWatchInterval;
    if (watch && !have_end && o_.nnodes > 1)
      store_call([&] {
        if (std::optional<Failure> f = coordinator.failure(round)) {
          std::fprintf(stderr, "mn-run: %s; stopping %s's %zu running rank(s)\n", f->what.c_str(),
                       node_name().c_str(), running);
          end_with(*f, Clock::now());
          begin_stop(SIGTERM);
        }
      });
    // Heartbeats: a launcher that dies without a word (SIGKILL, its machine gone) is noticed by node 0.
    if (o_.nnodes > 1 && !have_end && Clock::now() >= next_beat) {
      next_beat = Clock::now() + kHeartbeatInterval;
      store_call([&] {
        if (o_.node_rank != 0) return coordinator.beat(round);
        const std::vector<int> silent = coordinator.silent_nodes(round, kStoreCallTimeout);
        if (silent.empty()) return;
        gone_ = silent;  // not waited for at the end
        const Failure f{silent.front(), -1, 1, false,
                        mn::str("the mn-run of node(s) ", mn::dist::launch::node_list(silent),
                                " stopped answering (no heartbeat for ", kStoreCallTimeout.count() / 1000,
                                " s): its launcher or machine may be gone")};
        std::fprintf(stderr, "mn-run: %s; stopping %s's %zu running rank(s)\n", f.what.c_str(),
                     node_name().c_str(), running);
        end_with(f, Clock::now());
        coordinator.publish_failure(round, f);
        begin_stop(SIGTERM);
      });
    }
    if (running == 0 && have_end) break;
    // Every local rank succeeded: wait for the other nodes' ranks.
    if (running == 0 && !have_end && failures.empty() && (watch || o_.nnodes == 1)) {
      bool all_done = false;
      store_call([&] {
        if (!done_marked) coordinator.mark_done(round);
        done_marked = true;
        all_done = coordinator.all_done(round);
      });
      if (all_done) {
        if (o_.node_rank != 0) store_call([&] { coordinator.mark_left(round); });
        break;
      }
    }
    if (stopping && !killed && Clock::now() >= kill_deadline) {
      signal_all(children_, SIGKILL);
      killed = true;
    }
    // 20 ms: bounds how late the settle, watch and SIGKILL deadlines are noticed.
    if (const int sig = next_signal(std::chrono::milliseconds(20))) {
      if (end.signal == 0) end.signal = sig;
      // Forward as-is first (the ranks may shut down cleanly on SIGINT), then escalate like a failure.
      begin_stop(sig);
      if (!have_end) {
        const Failure f = stopped_by(sig);
        end_with(f, Clock::now());
        store_call([&] { coordinator.publish_failure(round, f); });  // the other nodes stop too
      }
    }
  }
  end.stopped = Clock::now();
  return end;
}

// Node 0 serves the store: it stays until every other node has seen how the round ended (bounded).
void Job::linger(int round) {
  const auto deadline = Clock::now() + kLingerTimeout;
  try {
    auto waiting = [&] {
      for (int node : coordinator_->not_left(round))
        if (std::find(gone_.begin(), gone_.end(), node) == gone_.end()) return true;
      return false;
    };
    while (waiting() && Clock::now() < deadline)
      if (next_signal(std::chrono::milliseconds(50)) != 0) return;
  } catch (const std::exception&) {
  }
}

int Job::run() {
  if (std::optional<int> code = open_store()) return *code;
  coordinator_.emplace(store_, mn::dist::launch::NodeConfig{o_.nnodes, o_.node_rank, o_.nproc, o_.max_restarts});
  if (std::optional<int> code = plan_ranks()) return *code;
  const auto rdzv_timeout =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::duration<double>(o_.rdzv_timeout));
  auto leave = [&](int round, int code) {
    if (o_.node_rank == 0) linger(round);
    return code;
  };
  std::optional<RoundEnd> previous;  // the failure the current round restarts after
  for (int round = 0;; ++round) {
    std::optional<Failure> refused;
    try {
      refused = coordinator_->rendezvous(round, rdzv_timeout, std::chrono::milliseconds(20),
                                         [&]() -> std::optional<Failure> {
                                           pending_signal_ = next_signal(std::chrono::milliseconds(0));
                                           if (pending_signal_ == 0) return std::nullopt;
                                           return stopped_by(pending_signal_);
                                         });
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "mn-run: failed: lost the connection to node 0's store at %s:%d during the rendezvous (%s)\n",
                   o_.master_addr.c_str(), o_.master_port, e.what());
      return 1;
    }
    if (refused) {
      std::fprintf(stderr, "mn-run: failed: %s\n", refused->what.c_str());
      if (o_.node_rank != 0) try {
          coordinator_->mark_left(round);
        } catch (const std::exception&) {
        }
      return leave(round, pending_signal_ ? 128 + pending_signal_ : std::max(1, refused->exit_code));
    }
    if (!start_ranks(round)) {
      try {  // the other nodes stop too
        coordinator_->publish_failure(round, Failure{o_.node_rank, -1, 1, false,
                                                     mn::str(node_name(), " could not start its ranks")});
      } catch (const std::exception&) {
      }
      return leave(round, 1);
    }
    if (previous)
      std::fprintf(stderr, "mn-run: restart %d/%d after %s (stopped the job in %.0f ms; ranks started again %.0f ms "
                   "after the failure)\n", round, o_.max_restarts, previous->failure.what.c_str(),
                   std::chrono::duration<double, std::milli>(previous->stopped - previous->seen).count(),
                   ms_since(previous->seen));
    RoundEnd end = supervise(round);
    if (!end.failed) return leave(round, 0);
    for (const Child& c : children_)
      if (failed(c.status) && !(end.failure.node == o_.node_rank && end.failure.rank == c.rank))
        std::fprintf(stderr, "mn-run:   %s (pid %d) %s\n", rank_name(c.rank).c_str(), c.pid,
                     describe_status(c.status).c_str());
    if (end.failure.restartable && round < o_.max_restarts) {
      if (end.signal == 0) {
        previous = end;
        continue;
      }
      // Stopped by a signal while the job was about to restart: the others would wait for this node in the
      // next round's rendezvous; tell them there instead.
      try {
        coordinator_->publish_failure(round + 1, stopped_by(end.signal));
      } catch (const std::exception&) {
      }
    }
    if (end.failure.rank < 0 && end.signal != 0 && end.failure.node == o_.node_rank) {
      std::fprintf(stderr, "mn-run: stopped by signal %d (%s)\n", end.signal, strsignal(end.signal));
      return leave(round, 128 + end.signal);
    }
    const std::string restarts =
        round > 0 ? mn::str(" (after ", round, " restart(s), --max-restarts ", o_.max_restarts, ")") : "";
    std::fprintf(stderr, "mn-run: failed: %s%s%s\n", end.failure.what.c_str(), end.failure.rank >= 0 ? " first" : "",
                 restarts.c_str());
    return leave(round, std::max(1, end.failure.exit_code));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (std::optional<int> code = parse_options(argc, argv, options)) return *code;
  // Signals are taken synchronously (sigtimedwait), so no handler races the bookkeeping. Blocked before
  // node 0's store starts its thread, which inherits the mask: the signals come to this thread.
  sigset_t handled, original;
  sigemptyset(&handled);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&handled, sig);
  sigprocmask(SIG_BLOCK, &handled, &original);
  signal(SIGPIPE, SIG_IGN);  // a store peer that went away is an error on the call, not the end of mn-run
  Job job(std::move(options), handled, original);
  return job.run();
}
