#include "mapping/profiler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <vector>

#include "autograd/node.h"
#include "mapping/generator.h"

namespace mn::mapping {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Waits for the device's queued work by copying one generated value to the host.
void wait_for(const ParameterTree& tree, Device device) {
  if (device.is_cpu() || tree.size() == 0) return;
  const Tensor& last = tree.items().back().second;
  if (last.numel() > 0) (void)last.detach().reshape({-1}).narrow(0, 0, 1).to(kCPU);
}

// "1.3 MB": bytes in B, kB, MB or GB (steps of 1e3), one decimal.
std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  char out[32];
  if (bytes < 1000) std::snprintf(out, sizeof out, "%lld B", static_cast<long long>(bytes));
  else if (b < 1e6) std::snprintf(out, sizeof out, "%.1f kB", b / 1e3);
  else if (b < 1e9) std::snprintf(out, sizeof out, "%.1f MB", b / 1e6);
  else std::snprintf(out, sizeof out, "%.1f GB", b / 1e9);
  return out;
}

StrategyStats measure(const std::string& strategy, const ParameterSpec& spec, int64_t latent_dim, Device device,
                      int n_warmup, int n_repeat, bool allow_large, const std::string& mapper) {
  StrategyStats stats;
  stats.dense_bytes = spec.total_numel() * latent_dim * 4;  // every strategy maps all N from L
  try {
    GeneratorOptions options;
    options.device = device;
    options.allow_large = allow_large;
    options.mapper = mapper;
    const auto build_start = std::chrono::steady_clock::now();
    std::unique_ptr<ParameterGenerator> gen = make_generator(strategy, spec, latent_dim, options);
    stats.build_time_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - build_start).count();
    stats.fixed_bytes = static_cast<int64_t>(gen->fixed_bytes());
    stats.dense_bytes = static_cast<int64_t>(gen->fixed_projection_bytes());
    // As in training: the latents require grad, so every call records its autograd graph.
    autograd::GradModeGuard grad_on(true);
    for (int i = 0; i < n_warmup; ++i) wait_for(gen->generate_parameters(), device);
    std::vector<double> times_ms;
    for (int i = 0; i < n_repeat; ++i) {
      const auto start = std::chrono::steady_clock::now();
      auto [tree, peak] = profile_peak_memory([&] { return gen->generate_parameters(); }, device);
      wait_for(tree, device);
      const auto stop = std::chrono::steady_clock::now();
      times_ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
      stats.peak_bytes = std::max(stats.peak_bytes, peak);
    }
    stats.generate_time_ms = median(times_ms);
  } catch (const std::exception& e) {
    stats.error = e.what();
  }
  return stats;
}

}  // namespace

std::map<std::string, StrategyStats> benchmark_strategies(const ParameterSpec& spec, int64_t latent_dim,
                                                          Device device, int n_warmup, int n_repeat,
                                                          bool allow_large, const std::string& mapper) {
  MN_CHECK(latent_dim > 0, ValueError, "benchmark_strategies: latent_dim must be positive, got ", latent_dim);
  MN_CHECK(n_warmup >= 0, ValueError, "benchmark_strategies: n_warmup must be non-negative, got ", n_warmup);
  MN_CHECK(n_repeat >= 1, ValueError, "benchmark_strategies: n_repeat must be at least 1, got ", n_repeat);
  MN_CHECK(spec.total_numel() > 0, ValueError, "benchmark_strategies: the spec holds no parameters");
  std::map<std::string, StrategyStats> results;
  for (const char* strategy : {"slvt", "layerwise", "lazy_layerwise"})
    results[strategy] = measure(strategy, spec, latent_dim, device, n_warmup, n_repeat, allow_large, mapper);
  return results;
}

std::string strategy_table(const std::map<std::string, StrategyStats>& results) {
  std::vector<std::string> order;
  for (const char* s : {"slvt", "layerwise", "lazy_layerwise"})
    if (results.count(s)) order.push_back(s);
  for (const auto& [name, stats] : results)
    if (std::find(order.begin(), order.end(), name) == order.end()) order.push_back(name);
  std::ostringstream os;
  for (const auto& name : order) {
    const StrategyStats& s = results.at(name);
    char line[240];
    if (s.ok())
      std::snprintf(line, sizeof line, "%-20s  peak=%7.2f MB  time=%6.2f ms  (%s B)  fixed=%s vs dense-equivalent %s",
                    name.c_str(), static_cast<double>(s.peak_bytes) / 1e6, s.generate_time_ms,
                    thousands(s.peak_bytes).c_str(), human_bytes(s.fixed_bytes).c_str(),
                    human_bytes(s.dense_bytes).c_str());
    else
      std::snprintf(line, sizeof line, "%-20s  failed: ", name.c_str());
    os << line << (s.ok() ? "" : s.error) << '\n';
  }
  return os.str();
}

}  // namespace mn::mapping
