// Training steps on a shared machine (issue 22, "Robust under contention, by default"): the CNN2
// layerwise 4 x 672 step (batch 256) and the MLP 784-256-256-10 layerwise L = 64 step (batch 64),
// idle and with one busy-loop process pinned to a CPU beside them (the benchmark forks it, pins it to
// the first CPU it may use, and kills it), under several thread settings, all in one process:
//   default   a thread that never set a count: the library's default policy (core/parallel.h;
//             MN_THREAD_POLICY, OMP_NUM_THREADS apply as they would to any program)
//   static    an explicit count of every CPU the process may use: what the default was before the
//             adaptive policy (the same as MN_THREAD_POLICY=static)
//   1, N - 1  explicit counts (N - 1 only on machines with more than two CPUs)
// Each block runs on a thread of its own (the counts are per thread); each setting has its own model
// and optimizer.
// Rounds interleave the settings (each round starting one setting later): in every round each setting
// runs a block of steps, the first 0.4 s of a block untimed (it lets the default policy's load
// measurement see the new state), then at least 0.5 s timed. Figures are medians and means over every
// timed step of a (load, setting).
// Counters (ms per step):
//   <load>_<setting>_ms       median step, load idle or busy, setting default, static, t1, tN-1
//   <load>_<setting>_mean_ms  mean step (timed steps' total time / their count)
//   busy_best_ms              the lowest busy mean of the fixed settings (static, 1, N - 1)
//   busy_ratio                busy_default_mean_ms / busy_best_ms        target <= 1.2
//   busy_static_ratio         busy_static_mean_ms / busy_best_ms         (the collapse the default avoids)
//   busy_median_ratio         the same as busy_ratio with medians (which miss the steps that wait for
//                             the busy core: see the comment at the figures)
//   idle_ratio                idle_default_ms / idle_static_ms (medians)   target <= 1.03
//   team_idle, team_busy      the default's mean team size after its timed steps
//   load_avg                  the 1-minute load average when the run started (other processes)
// BM_Quota runs the same settings with the whole process in a cgroup limited to one CPU's time per
// period (QuotaCgroup: what a container's --cpus 1 does; skipped where no cgroup can be made), counters
// named as the busy ones with "quota": quota_<setting>_ms / _mean_ms, quota_best_ms, quota_ratio
// (target <= 1.2), quota_static_ratio, quota_median_ratio, team_quota.
// MN_BENCH_CONTENTION_ROUNDS sets the rounds (default 3).
//
// What the policy costs an idle step, measured without depending on the load: BM_TeamQuery is the
// query every parallel region makes (get_num_threads_in_use on a thread without a count: a coarse
// clock read between samples), BM_LoadSample one sample (/proc/stat's cpu lines, the affinity mask,
// the process CPU time), taken once per 200 ms.
#include <benchmark/benchmark.h>
#include <signal.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu_load.h"
#include "core/parallel.h"
#include "core/random.h"
#include "mapping/mapping_model.h"
#include "mapping/targets.h"
#include "nn/functional.h"
#include "nn/optim.h"

using namespace mn;
namespace F = mn::nn::functional;

namespace {

using Clock = std::chrono::steady_clock;

// Runs job() on a new thread with `threads` set (0: none, the default policy) and waits for it. A
// thread of its own per block: libgomp keeps a pool of workers for every thread that ran a team, and
// spins shorter while it manages more threads than there are CPUs, so the benchmark's main thread
// runs no team and no pool outlives its block, as in a program with one training thread.
void on_thread(int threads, const std::function<void()>& job) {
  std::thread([&] {
    if (threads > 0) set_num_threads(threads);
    job();
  }).join();
}

// One busy-loop process pinned to `cpu`, killed by the destructor (and by the kernel if we die first).
class BusyLoop {
 public:
  explicit BusyLoop(int cpu) {
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpu, &set);
      sched_setaffinity(0, sizeof set, &set);
      volatile unsigned long spins = 0;
      for (;;) spins = spins + 1;
    }
  }
  ~BusyLoop() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  bool running() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
};

// A child of this process's cgroup with a CPU quota (`cpus` CPUs' time per 100 ms period), which the
// whole process joins while the object lives (moved back and the child removed after): what a
// container's --cpus does. Needs a writable cpu controller (cgroup v1, or v2 with the cpu controller
// enabled for our cgroup's children; in practice root); error() says why not otherwise.
class QuotaCgroup {
 public:
  explicit QuotaCgroup(double cpus) {
    std::ifstream c("/proc/self/cgroup"), m("/proc/self/mountinfo");
    const std::string cgroup{std::istreambuf_iterator<char>(c), {}}, mounts{std::istreambuf_iterator<char>(m), {}};
    const cpu_load::CgroupCpuDirs where = cpu_load::cgroup_cpu_dirs(cgroup, mounts);
    if (where.dirs.empty()) {
      error_ = "no cgroup cpu controller found in /proc/self/cgroup and /proc/self/mountinfo";
      return;
    }
    parent_ = where.dirs.front();
    dir_ = parent_ + "/mn_bench_quota_" + std::to_string(::getpid());
    if (::mkdir(dir_.c_str(), 0755) != 0) {
      error_ = "cannot create " + dir_ + ": " + std::strerror(errno);
      dir_.clear();
      return;
    }
    const long period = 100000, quota = std::lround(cpus * period);
    const bool limited = where.v2 ? write(dir_ + "/cpu.max", std::to_string(quota) + " " + std::to_string(period))
                                  : write(dir_ + "/cpu.cfs_period_us", std::to_string(period)) &&
                                        write(dir_ + "/cpu.cfs_quota_us", std::to_string(quota));
    if (!limited || !write(dir_ + "/cgroup.procs", std::to_string(::getpid()))) {
      error_ = "cannot set a quota in " + dir_ + " or join it (" + std::strerror(errno) + ")";
      return;
    }
    joined_ = true;
  }
  ~QuotaCgroup() {
    if (joined_) write(parent_ + "/cgroup.procs", std::to_string(::getpid()));
    if (!dir_.empty()) ::rmdir(dir_.c_str());
  }
  QuotaCgroup(const QuotaCgroup&) = delete;
  QuotaCgroup& operator=(const QuotaCgroup&) = delete;
  bool joined() const { return joined_; }
  const std::string& error() const { return error_; }

 private:
  static bool write(const std::string& path, const std::string& text) {
    std::ofstream f(path);
    f << text << '\n';
    f.flush();
    return static_cast<bool>(f);
  }
  std::string parent_, dir_, error_;
  bool joined_ = false;
};

int first_allowed_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) return c;
  return 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double mean(const std::vector<double>& v) {
  double t = 0;
  for (double x : v) t += x;
  return v.empty() ? 0 : t / static_cast<double>(v.size());
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A layerwise-mapped model, its optimizer and a fixed batch: one training step per call.
struct MappedStep {
  MappedStep(const std::string& target, int64_t latent, const Shape& input) {
    manual_seed(0);
    mapping::MappingOptions o;
    o.latent_dim = latent;
    o.strategy = "layerwise";
    model = std::make_unique<mapping::MappingModel>(mapping::make_target(target), o);
    adam = std::make_unique<nn::optim::Adam>(model->parameters(), nn::optim::AdamOptions{.lr = 1e-2});
    Generator gen(7);
    x = randn(input, DType::f32, &gen);
    y = uniform({input[0]}, 0.0, 10.0, DType::f32, &gen).to(DType::i64);
  }
  void operator()() {
    Tensor loss = F::cross_entropy(model->run(x).predictions, y);
    adam->zero_grad();
    loss.backward();
    adam->step();
  }
  std::unique_ptr<mapping::MappingModel> model;
  std::unique_ptr<nn::optim::Adam> adam;
  Tensor x, y;
};

struct Setting {
  std::string name;
  int threads;  // 0: the default policy
  std::unique_ptr<MappedStep> step;
  std::map<std::string, std::vector<double>> ms;  // per load
  std::map<std::string, std::vector<double>> team;
};

// Each block: kLeadIn seconds untimed (the default policy counts a core as taken within 0.2-0.4 s of
// the load appearing), then at least kTimed seconds timed (long enough for the means to hold a fair
// share of the steps that wait for a busy core).
constexpr double kLeadIn = 0.4, kTimed = 0.5;

int rounds() {
  const char* env = std::getenv("MN_BENCH_CONTENTION_ROUNDS");
  const int r = env ? std::atoi(env) : 0;
  return r > 0 ? r : 3;
}

// The settings' steps under each of `loads`: "idle", "busy" (one busy-loop process pinned beside us) or
// "quota" (this process in a cgroup limited to one CPU's time: QuotaCgroup).
void contention(benchmark::State& state, const std::string& target, int64_t latent, const Shape& input,
                const std::vector<std::string>& loads) {
  const int cpus = std::max(1, get_num_threads());
  std::vector<Setting> settings;
  settings.push_back({"default", 0, nullptr, {}, {}});
  settings.push_back({"static", cpus, nullptr, {}, {}});
  if (cpus > 1) settings.push_back({"t1", 1, nullptr, {}, {}});
  if (cpus > 2) settings.push_back({"t" + std::to_string(cpus - 1), cpus - 1, nullptr, {}, {}});
  for (Setting& s : settings)
    on_thread(s.threads, [&] {
      s.step = std::make_unique<MappedStep>(target, latent, input);
      (*s.step)();
    });
  double load_avg[1] = {0};
  getloadavg(load_avg, 1);
  const int n_rounds = rounds();
  for (auto _ : state) {
    const auto start = Clock::now();
    for (const std::string& load : loads) {
      std::optional<BusyLoop> busy;
      if (load == "busy") busy.emplace(first_allowed_cpu());
      std::optional<QuotaCgroup> quota;
      if (load == "quota") {
        quota.emplace(1.0);
        if (!quota->joined()) {
          state.SkipWithError(("needs a cgroup to set a CPU quota in: " + quota->error()).c_str());
          return;
        }
      }
      // Round r starts at setting r (mod their count), so each setting follows each other one in turn:
      // a block right after the static setting's under a quota ran 15-20 % slower whatever it was (the
      // throttled group's state lasted past the lead-in).
      for (int r = 0; r < n_rounds; ++r)
        for (size_t i = 0; i < settings.size(); ++i) {
          Setting& s = settings[(i + static_cast<size_t>(r)) % settings.size()];
          on_thread(s.threads, [&] {
            const auto block = Clock::now();
            while (seconds_since(block) < kLeadIn) (*s.step)();
            const auto timed = Clock::now();
            do {
              const auto t0 = Clock::now();
              (*s.step)();
              s.ms[load].push_back(seconds_since(t0) * 1e3);
              s.team[load].push_back(get_num_threads_in_use());
            } while (seconds_since(timed) < kTimed || s.ms[load].size() < static_cast<size_t>(3 * (r + 1)));
          });
        }
    }
    state.SetIterationTime(seconds_since(start));
  }
  auto figure = [&](const std::string& setting, const std::string& load) {
    for (const Setting& s : settings)
      if (s.name == setting) return median(s.ms.at(load));
    return 0.0;
  };
  for (const Setting& s : settings)
    for (const auto& [load, v] : s.ms) {
      state.counters[load + "_" + s.name + "_ms"] = median(v);
      state.counters[load + "_" + s.name + "_mean_ms"] = mean(v);
    }
  // Under load a step's time has two modes: most steps run at full pace, and some wait several
  // milliseconds while the busy process holds the core a worker needs (the scheduler's time slice).
  // The median sees only the first; the mean is what an epoch takes. So the load figures compare means
  // (and the medians are kept beside them), idle ones medians (no such modes, and robust to noise).
  auto mean_of = [&](const std::string& setting, const std::string& load) {
    for (const Setting& s : settings)
      if (s.name == setting) return mean(s.ms.at(load));
    return 0.0;
  };
  for (const std::string& load : loads) {
    state.counters["team_" + load] = mean(settings[0].team.at(load));
    if (load == "idle") {
      state.counters["idle_ratio"] = figure("default", "idle") / figure("static", "idle");
      continue;
    }
    double best = mean_of("static", load), best_median = figure("static", load);
    for (const Setting& s : settings)
      if (s.threads > 0) {
        best = std::min(best, mean(s.ms.at(load)));
        best_median = std::min(best_median, median(s.ms.at(load)));
      }
    state.counters[load + "_best_ms"] = best;
    state.counters[load + "_ratio"] = mean_of("default", load) / best;
    state.counters[load + "_static_ratio"] = mean_of("static", load) / best;
    state.counters[load + "_median_ratio"] = figure("default", load) / best_median;
  }
  state.counters["cpus"] = cpus;
  state.counters["load_avg"] = load_avg[0];
  state.SetLabel(target + " layerwise " + std::to_string(settings[0].step->model->generator().groups().size()) + "x" +
                 std::to_string(latent) + " batch " + std::to_string(input[0]));
  for (Setting& s : settings) on_thread(0, [&] { s.step.reset(); });
}

}  // namespace

static void BM_Contention(benchmark::State& state) {
  if (state.range(0) == 0)
    contention(state, "cnn2", 672, {256, 1, 28, 28}, {"idle", "busy"});
  else
    contention(state, "mlp", 64, {64, 784}, {"idle", "busy"});
}
BENCHMARK(BM_Contention)
    ->DenseRange(0, 1)
    ->ArgName("target")
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();

// The same steps with the process in a cgroup limited to one CPU's time per period (a container's
// --cpus 1): skipped where no cgroup can be made.
static void BM_Quota(benchmark::State& state) {
  if (state.range(0) == 0)
    contention(state, "cnn2", 672, {256, 1, 28, 28}, {"quota"});
  else
    contention(state, "mlp", 64, {64, 784}, {"quota"});
}
BENCHMARK(BM_Quota)->DenseRange(0, 1)->ArgName("target")->Iterations(1)->Unit(benchmark::kMillisecond)->UseManualTime();

static void BM_TeamQuery(benchmark::State& state) {
  int sum = 0;
  on_thread(0, [&] {
    for (auto _ : state) benchmark::DoNotOptimize(sum += get_num_threads_in_use());
  });
  state.counters["team"] = static_cast<double>(sum) / static_cast<double>(std::max<int64_t>(1, state.iterations()));
}
BENCHMARK(BM_TeamQuery)->Unit(benchmark::kNanosecond);

static void BM_LoadSample(benchmark::State& state) {
  for (auto _ : state) cpu_load::monitor().sample_now();
}
BENCHMARK(BM_LoadSample)->Unit(benchmark::kMicrosecond);
