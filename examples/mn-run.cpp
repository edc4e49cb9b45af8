// mn-run: starts N copies of a program as the ranks of one job on this machine, like torchrun.
//
//   mn-run --nproc-per-node 4 [--master-port 29500] ./train --epochs 3
//
// Each child gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free
// port when --master-port is 0 or absent). SIGINT/SIGTERM/SIGHUP sent to mn-run are forwarded to every
// rank. When one rank fails (non-zero exit or a signal), the others get SIGTERM and, after a grace
// period, SIGKILL; mn-run then exits non-zero and names the rank that failed first. Each child runs in its
// own process group and receives SIGTERM should mn-run itself die, so no rank outlives the launcher.
// Unless OMP_NUM_THREADS is set, each of N > 1 ranks gets cores / N OpenMP threads (torchrun sets 1), so
// the ranks do not oversubscribe the machine; "cores" are the CPUs mn-run may run on (its affinity mask).
// --bind-cores pins rank r to its own block of cores / N of those CPUs (r-th block, in CPU order) before
// it starts: ranks then neither migrate nor share a core, which keeps the synchronised steps of data
// parallel training in lock step on a machine the ranks fill (leftover CPUs stay unused).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
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

namespace {

using Clock = std::chrono::steady_clock;

struct Child {
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
};

// A port nobody listens on right now (bind to port 0, read it back, release it). Another process could
// take it before rank 0 binds it; the store then reports "address in use" clearly.
int pick_free_port(const std::string& address) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = 0;
  if (inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    socklen_t len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "ended with status " + std::to_string(status);
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// The shell convention: the child's exit code, or 128 + the signal that killed it.
int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The CPUs this process may run on, in increasing order (all online CPUs when the mask cannot be read).
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  if (cpus.empty())
    for (unsigned cpu = 0; cpu < std::max(1u, std::thread::hardware_concurrency()); ++cpu)
      cpus.push_back(static_cast<int>(cpu));
  return cpus;
}

// "0-3,8,10-11"
std::string cpu_list_text(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(cpus[i]);
    if (j > i) out += "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

// Runs in the child between fork and exec: only async-signal-safe calls plus setenv (single-threaded here).
// `cpus`, when not empty, becomes the child's affinity mask.
[[noreturn]] void exec_rank(const std::vector<std::string>& command,
                            const std::vector<std::pair<std::string, std::string>>& env, const std::vector<int>& cpus,
                            pid_t launcher, const sigset_t& original_mask) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != launcher) _exit(128 + SIGTERM);  // the launcher died before prctl took effect
  sigprocmask(SIG_SETMASK, &original_mask, nullptr);
  for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      std::fprintf(stderr, "mn-run: cannot bind to CPUs: %s\n", std::strerror(errno));
      _exit(127);
    }
  }
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  std::fprintf(stderr, "mn-run: cannot execute '%s': %s\n", argv[0], std::strerror(errno));
  _exit(127);
}

void signal_all(std::vector<Child>& children, int sig) {
  for (const Child& c : children)
    if (c.running && kill(-c.pid, sig) != 0) kill(c.pid, sig);  // the group first (grandchildren too)
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Starts N ranks of a program on this machine (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)"};
  int nproc = 1;
  int master_port = 0;
  std::string master_addr = "127.0.0.1";
  double grace_seconds = 5.0;
  bool bind_cores = false;
  mn::examples::add_version_flag(app, "mn-run");
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "Number of ranks to start")
      ->check(mn::examples::whole_number_in_range(1, 1024));
  app.add_option("--master-port,--master_port", master_port, "Port of rank 0's store (0: pick a free one)")
      ->check(mn::examples::whole_number_in_range(0, 65535));
  app.add_option("--master-addr,--master_addr", master_addr, "Address of rank 0 (this machine)");
  app.add_option("--grace-period", grace_seconds, "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(mn::examples::finite_number_in_range(0, 3600));
  app.add_flag("--bind-cores", bind_cores,
               "Pin each rank to its own block of (available CPUs / N) CPUs; OpenMP threads default to the block");
  app.prefix_command();  // everything from the program name on belongs to the program
  app.footer("Example: mn-run --nproc-per-node 2 mn-train --backend gloo --epochs 3");
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> command = app.remaining();
  if (!command.empty() && command.front() == "--") command.erase(command.begin());
  if (command.empty()) {
    std::fprintf(stderr,
                 "mn-run: expected a program to run after the options, e.g. mn-run --nproc-per-node 2 ./train\n");
    return 2;
  }
  if (master_port == 0) {
    master_port = pick_free_port(master_addr);
    if (master_port <= 0) {
      std::fprintf(stderr, "mn-run: could not find a free port on %s: %s\n", master_addr.c_str(),
                   std::strerror(errno));
      return 1;
    }
  }

  // Signals are taken synchronously (sigtimedwait), so no handler races the bookkeeping below.
  sigset_t handled, original;
  sigemptyset(&handled);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&handled, sig);
  sigprocmask(SIG_BLOCK, &handled, &original);

  std::vector<std::pair<std::string, std::string>> common = {
      {"WORLD_SIZE", std::to_string(nproc)},
      {"LOCAL_WORLD_SIZE", std::to_string(nproc)},
      {"MASTER_ADDR", master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"GROUP_RANK", "0"},
  };
  const std::vector<int> cpus = allowed_cpus();
  const size_t per_rank = std::max<size_t>(1, cpus.size() / static_cast<size_t>(nproc));
  if (bind_cores && cpus.size() < static_cast<size_t>(nproc)) {
    std::fprintf(stderr, "mn-run: --bind-cores needs at least one CPU per rank: %d ranks, %zu CPU(s) available (%s)\n",
                 nproc, cpus.size(), cpu_list_text(cpus).c_str());
    return 2;
  }
  // N ranks each starting one OpenMP thread per core would oversubscribe the machine (torchrun sets 1).
  if ((nproc > 1 || bind_cores) && std::getenv("OMP_NUM_THREADS") == nullptr)
    common.push_back({"OMP_NUM_THREADS", std::to_string(per_rank)});
  std::vector<std::vector<int>> rank_cpus(static_cast<size_t>(nproc));
  if (bind_cores) {
    std::string plan;
    for (size_t r = 0; r < rank_cpus.size(); ++r) {
      rank_cpus[r].assign(cpus.begin() + static_cast<std::ptrdiff_t>(r * per_rank),
                          cpus.begin() + static_cast<std::ptrdiff_t>((r + 1) * per_rank));
      plan += (r ? ", " : "") + std::to_string(r) + ": " + cpu_list_text(rank_cpus[r]);
    }
    std::fprintf(stderr, "mn-run: binding %d rank(s) to %zu CPU(s) each (%s)\n", nproc, per_rank, plan.c_str());
  }

  const pid_t launcher = getpid();
  std::vector<Child> children(static_cast<size_t>(nproc));
  for (int rank = 0; rank < nproc; ++rank) {
    auto env = common;
    env.push_back({"RANK", std::to_string(rank)});
    env.push_back({"LOCAL_RANK", std::to_string(rank)});
    const pid_t pid = fork();
    if (pid == 0) exec_rank(command, env, rank_cpus[static_cast<size_t>(rank)], launcher, original);
    if (pid < 0) {
      std::fprintf(stderr, "mn-run: fork for rank %d failed: %s\n", rank, std::strerror(errno));
      signal_all(children, SIGKILL);
      while (wait(nullptr) > 0) {
      }
      return 1;
    }
    setpgid(pid, pid);  // also here, so a signal sent right away already reaches the child's group
    children[static_cast<size_t>(rank)] = Child{rank, pid, true, 0};
  }

  // A dead rank's peers often notice its closed sockets and exit before the kernel reports the death
  // itself, so failures are collected for a short while and a rank killed by a signal is named as the
  // cause ahead of ranks that merely exited with an error.
  const auto settle = std::chrono::milliseconds(250);
  std::vector<size_t> failures;
  std::optional<Clock::time_point> settle_until;
  std::optional<size_t> first_failure;
  int received_signal = 0;
  bool terminating = false, killed = false;
  Clock::time_point kill_deadline{};
  const auto grace = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_seconds));
  size_t running = children.size();
  auto name_first_failure = [&] {
    first_failure = failures.front();
    for (size_t i : failures)
      if (WIFSIGNALED(children[i].status)) {
        first_failure = i;
        break;
      }
    const Child& c = children[*first_failure];
    if (running > 0)
      std::fprintf(stderr, "mn-run: rank %d (pid %d) %s; stopping the other %zu rank(s)\n", c.rank, c.pid,
                   describe_status(c.status).c_str(), running);
    else
      std::fprintf(stderr, "mn-run: rank %d (pid %d) %s\n", c.rank, c.pid, describe_status(c.status).c_str());
  };
  auto begin_termination = [&] {
    if (terminating) return;
    terminating = true;
    kill_deadline = Clock::now() + grace;
    signal_all(children, SIGTERM);
  };

  while (running > 0) {
    int status = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
      for (size_t i = 0; i < children.size(); ++i) {
        Child& c = children[i];
        if (c.pid != pid || !c.running) continue;
        c.running = false;
        c.status = status;
        --running;
        if (failed(status) && !terminating) {
          failures.push_back(i);
          if (!settle_until) settle_until = Clock::now() + settle;
        }
      }
    }
    if (settle_until && !terminating && (Clock::now() >= *settle_until || running == 0)) {
      name_first_failure();
      begin_termination();
    }
    if (running == 0) break;
    if (terminating && !killed && Clock::now() >= kill_deadline) {
      signal_all(children, SIGKILL);
      killed = true;
    }
    timespec pause{0, 20'000'000};  // 20 ms: bounds how late the settle and SIGKILL deadlines are noticed
    siginfo_t info;
    const int sig = sigtimedwait(&handled, &info, &pause);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (received_signal == 0) received_signal = sig;
      // Forward as-is first (the ranks may shut down cleanly on SIGINT), then escalate like a failure.
      signal_all(children, sig);
      if (!terminating) {
        terminating = true;
        kill_deadline = Clock::now() + grace;
      }
    }
  }

  if (!first_failure && !failures.empty()) name_first_failure();  // failed while stopping on a signal
  if (first_failure) {
    const Child& c = children[*first_failure];
    for (const Child& other : children)
      if (&other != &c && failed(other.status))
        std::fprintf(stderr, "mn-run:   rank %d (pid %d) %s\n", other.rank, other.pid,
                     describe_status(other.status).c_str());
    std::fprintf(stderr, "mn-run: failed: rank %d %s first\n", c.rank, describe_status(c.status).c_str());
    return exit_code_of(c.status) == 0 ? 1 : exit_code_of(c.status);
  }
  if (received_signal != 0) {
    std::fprintf(stderr, "mn-run: stopped by signal %d (%s)\n", received_signal, strsignal(received_signal));
    return 128 + received_signal;
  }
  return 0;
}
