// mn-strategies: the scaling guide's memory benchmark. Builds the slvt, layerwise and lazy_layerwise
// generators for a target's parameter layout (without parameter scaling) and prints, per strategy,
// the peak memory one generate_parameters() call adds - exact caching-allocator bytes, gradients
// enabled as in training - and its median time, then the bytes the generator keeps (its mapper factors
// and scales) beside the size of the same maps stored densely (rows x L x 4 bytes, what the reference
// Python library materialises):
//
//   $ mn-strategies --spec guide --latent-dim 64   (--config FILE / --write-config FILE: the options as TOML)
//   slvt                  peak=   0.62 MB  time= 53.81 ms  (617,984 B)  fixed=342.8 kB vs dense-equivalent 19.7 MB
//   ...
// slvt refuses a mapper matrix that would store more than 1e8 elements (the block family at a latent
// above ~10,000; the dense family at L x N > 1e8); --allow-large builds it anyway.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli_checks.h"
#include "mapping/generator.h"
#include "mapping/profiler.h"
#include "mapping/targets.h"

using namespace mn;
using namespace mn::examples;

int main(int argc, char** argv) {
  CLI::App app{"Peak memory and time of parameter generation per strategy (the scaling guide's table)"};
  std::string spec_name = "guide", device_name = "cpu";
  int64_t latent_dim = 64;
  int n_warmup = 2, n_repeat = 5;
  std::vector<int64_t> mlp_hidden{256, 256};
  bool details = false, allow_large = false;
  std::string write_config;
  std::string mapper = "block";  // the mapper family (GeneratorOptions::mapper)
  add_version_flag(app, "mn-strategies");
  add_config_options(app, write_config);
  app.add_option("--spec", spec_name,
                 "parameter layout: guide (Conv2d(3,64,3), Conv2d(64,128,3), Linear(128,10)) "
                 "or a built-in target")
      ->check(CLI::IsMember(mapping::spec_names()))
      ->capture_default_str();
  const int64_t int_max = std::numeric_limits<int>::max();
  app.add_option("--latent-dim", latent_dim, "latent length per group")
      ->check(whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--mlp-hidden", mlp_hidden, "hidden widths of --spec mlp")
      ->check(whole_number_at_least(1))
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--warmup", n_warmup, "discarded calls per strategy")
      ->check(whole_number_in_range(0, int_max))
      ->capture_default_str();
  app.add_option("--repeat", n_repeat, "measured calls per strategy")
      ->check(whole_number_in_range(1, int_max))
      ->capture_default_str();
  app.add_option("--device", device_name, "cpu, cuda[:N] or auto")->capture_default_str();
  app.add_flag("--allow-large", allow_large,
               "build slvt even when its mapper matrix would store more than 1e8 elements (the block family "
               "above L ~ 10,000, dense above L x N = 1e8)");
  app.add_flag("--details", details, "also print the layout, the groups and each generator's fixed bytes");
  app.add_option("--mapper", mapper, "the mapper family of the fixed matrices: block, dense or srht")
      ->check(CLI::IsMember({"block", "dense", "srht"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    if (write_config_if_asked(app, write_config, "mn-strategies")) return 0;
    const Device device = Device::parse(device_name);
    if (device.is_cuda())
      MN_CHECK(cuda_available() && device.index < cuda_device_count(), DeviceError, "--device ", device_name,
               ": CUDA is not available here (built without CUDA, or no usable GPU)");
    const mapping::ParameterSpec spec = mapping::target_spec(spec_name, {mlp_hidden});
    auto results = mapping::benchmark_strategies(spec, latent_dim, device, n_warmup, n_repeat, allow_large, mapper);
    for (auto& [name, stats] : results)  // the guard speaks of GeneratorOptions::allow_large; here it is a flag
      if (!stats.ok() && stats.error.find("allow_large") != std::string::npos) stats.error += "; here: --allow-large";
    if (details) {
      std::printf("spec %s: %zu tensors, %lld parameters, %zu layer-wise groups, latent_dim %lld, %s, mapper %s\n",
                  spec_name.c_str(), spec.size(), static_cast<long long>(spec.total_numel()),
                  mapping::layerwise_groups(spec).size(), static_cast<long long>(latent_dim),
                  device.str().c_str(), mapper.c_str());
      for (const auto& [name, stats] : results)
        if (stats.ok())
          std::printf("  %-16s fixed mapper factors %lld B, built in %.1f ms\n", name.c_str(),
                      static_cast<long long>(stats.fixed_bytes), stats.build_time_ms);
    }
    std::fputs(mapping::strategy_table(results).c_str(), stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mn-strategies: %s\n", e.what());
    return 1;
  }
  return 0;
}
