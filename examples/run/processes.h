#pragma once
// mn-run's handling of its rank processes (examples/mn-run.cpp): starting one with its environment and
// CPUs without allocating after fork, signalling them, and describing how they ended.
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

namespace mn::examples::run {

using Env = std::vector<std::pair<std::string, std::string>>;

struct Child {
  int rank = 0;  // global
  pid_t pid = -1;
  bool running = false;
  int status = 0;
};

inline std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "ended with status " + std::to_string(status);
}

inline bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }

// The shell convention: the child's exit code, or 128 + the signal that killed it.
inline int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The CPUs this process may run on, in increasing order (all online CPUs when the mask cannot be read).
inline std::vector<int> allowed_cpus() {
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
inline std::string cpu_list_text(const std::vector<int>& cpus) {
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

// Everything a child needs between fork and exec, built beforehand: node 0's store serves from a thread,
// so the child may not allocate (that thread could hold the allocator's lock at the fork).
struct ExecPlan {
  std::vector<std::string> strings;  // owns the text argv and envp point into
  std::vector<char*> argv, envp;
  std::vector<int> cpus;  // the child's affinity mask when not empty
};

inline ExecPlan plan_exec(const std::vector<std::string>& command, const Env& env, std::vector<int> cpus) {
  ExecPlan plan;
  plan.cpus = std::move(cpus);
  plan.strings = command;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    if (std::none_of(env.begin(), env.end(), [&](const auto& kv) { return kv.first == name; }))
      plan.strings.push_back(entry);
  }
  for (const auto& [name, value] : env) plan.strings.push_back(name + "=" + value);
  for (size_t i = 0; i < plan.strings.size(); ++i)
    (i < command.size() ? plan.argv : plan.envp).push_back(plan.strings[i].data());
  plan.argv.push_back(nullptr);
  plan.envp.push_back(nullptr);
  return plan;
}

[[noreturn]] inline void fail_in_child(const char* what, const char* name) {
  char message[512];
  const int n = std::snprintf(message, sizeof(message), "mn-run: %s%s%s%s: %s\n", what, name ? " '" : "",
                              name ? name : "", name ? "'" : "", std::strerror(errno));
  if (n > 0) {
    [[maybe_unused]] ssize_t written = ::write(STDERR_FILENO, message, std::min<size_t>(n, sizeof(message) - 1));
  }
  _exit(127);
}

// Runs in the child between fork and exec.
[[noreturn]] inline void exec_rank(const ExecPlan& plan, pid_t launcher, const sigset_t& original_mask) {
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != launcher) _exit(128 + SIGTERM);  // the launcher died before prctl took effect
  signal(SIGPIPE, SIG_DFL);                         // the launcher ignores it; the program gets the default
  sigprocmask(SIG_SETMASK, &original_mask, nullptr);
  if (!plan.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : plan.cpus) CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) fail_in_child("cannot bind to CPUs", nullptr);
  }
  execvpe(plan.argv[0], plan.argv.data(), plan.envp.data());
  fail_in_child("cannot execute", plan.argv[0]);
}

inline void signal_all(std::vector<Child>& children, int sig) {
  for (const Child& c : children)
    if (c.running && kill(-c.pid, sig) != 0) kill(c.pid, sig);  // the group first (grandchildren too)
}
}  // namespace mn::examples::run
