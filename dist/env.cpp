#include "dist/env.h"

#include <charconv>
#include <cstdlib>
#include <limits>

#include "core/error.h"

namespace mn::dist {

namespace {

constexpr const char* kLaunchHint =
    " (launch with mn-run --nproc-per-node N, or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT)";

std::string quoted(const std::string& name, const std::string& text) { return str(name, "='", text, "'"); }

std::string required(const std::function<std::optional<std::string>(const std::string&)>& lookup,
                     const std::string& name) {
  std::optional<std::string> value = lookup(name);
  MN_CHECK(value.has_value(), ValueError, "environment variable ", name, " is not set", kLaunchHint);
  MN_CHECK(!value->empty(), ValueError, "environment variable ", name, " is empty", kLaunchHint);
  return *value;
}

}  // namespace

int64_t parse_int_variable(const std::string& name, const std::string& text) {
  int64_t value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [stop, ec] = std::from_chars(begin, end, value);
  MN_CHECK(!text.empty() && ec == std::errc() && stop == end, ValueError, "environment variable ",
           quoted(name, text), " is not an integer");
  return value;
}

uint16_t parse_port_variable(const std::string& name, const std::string& text) {
  int64_t value = 0;
  try {
    value = parse_int_variable(name, text);
  } catch (const ValueError&) {
    throw ValueError(str("environment variable ", quoted(name, text), " is not a port number (1-65535)"));
  }
  MN_CHECK(value >= 1 && value <= 65535, ValueError, "environment variable ", quoted(name, text),
           " is not a port number (1-65535)");
  return static_cast<uint16_t>(value);
}

namespace {

// The variable's value as an int in [low, INT_MAX] (low is 0 or 1), or ValueError saying what it should be.
int int_at_least(const std::string& name, const std::string& text, int low) {
  const char* expected = low == 0 ? " is not a non-negative integer" : " is not a positive integer";
  int64_t v = 0;
  try {
    v = parse_int_variable(name, text);
  } catch (const ValueError&) {
    throw ValueError(str("environment variable ", quoted(name, text), expected));
  }
  MN_CHECK(v >= low && v <= std::numeric_limits<int>::max(), ValueError, "environment variable ", quoted(name, text),
           expected);
  return static_cast<int>(v);
}

}  // namespace

EnvConfig parse_env(const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  auto non_negative = [](const std::string& name, const std::string& text) { return int_at_least(name, text, 0); };
  auto positive = [](const std::string& name, const std::string& text) { return int_at_least(name, text, 1); };

  EnvConfig config;
  const std::string world_text = required(lookup, "WORLD_SIZE");
  config.world_size = positive("WORLD_SIZE", world_text);
  const std::string rank_text = required(lookup, "RANK");
  config.rank = non_negative("RANK", rank_text);
  MN_CHECK(config.rank < config.world_size, ValueError, "environment variable RANK=", config.rank,
           " must be less than WORLD_SIZE=", config.world_size);
  config.master_addr = required(lookup, "MASTER_ADDR");
  config.master_port = parse_port_variable("MASTER_PORT", required(lookup, "MASTER_PORT"));

  config.local_world_size = config.world_size;
  if (auto text = lookup("LOCAL_WORLD_SIZE"); text && !text->empty())
    config.local_world_size = positive("LOCAL_WORLD_SIZE", *text);
  config.local_rank = config.rank;
  if (auto text = lookup("LOCAL_RANK"); text && !text->empty()) {
    config.local_rank = non_negative("LOCAL_RANK", *text);
    MN_CHECK(config.local_rank < config.local_world_size, ValueError,
             "environment variable LOCAL_RANK=", config.local_rank,
             " must be less than LOCAL_WORLD_SIZE=", config.local_world_size);
  }
  return config;
}

namespace {
std::optional<std::string> process_variable(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}
}  // namespace

EnvConfig from_env() { return parse_env(process_variable); }

std::string AgentStore::prefix() const { return str("/worker/attempt_", restart_count); }

AgentStore parse_agent_store(const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  AgentStore agent;
  if (auto text = lookup("TORCHELASTIC_USE_AGENT_STORE"); text && !text->empty()) {
    const std::string& v = *text;
    MN_CHECK(v == "True" || v == "true" || v == "1" || v == "False" || v == "false" || v == "0", ValueError,
             "environment variable ", quoted("TORCHELASTIC_USE_AGENT_STORE", v), " is not True or False");
    agent.used = v == "True" || v == "true" || v == "1";
  }
  if (auto text = lookup("TORCHELASTIC_RESTART_COUNT"); text && !text->empty())
    agent.restart_count = int_at_least("TORCHELASTIC_RESTART_COUNT", *text, 0);
  return agent;
}

AgentStore agent_store_from_env() { return parse_agent_store(process_variable); }

// ---- MPI launchers ----

namespace {

// An integer variable in [low, INT_MAX], or nullopt when unset or empty.
std::optional<int> int_variable_at_least(const std::function<std::optional<std::string>(const std::string&)>& lookup,
                                         const std::string& name, int low) {
  const std::optional<std::string> text = lookup(name);
  if (!text || text->empty()) return std::nullopt;
  return int_at_least(name, *text, low);
}

}  // namespace

MpiLaunchEnv parse_mpi_env(const std::function<std::optional<std::string>(const std::string&)>& lookup) {
  struct Names {
    const char* rank;
    const char* size;  // nullptr: this launcher's variables give no size
  };
  MpiLaunchEnv env;
  for (const Names& names : {Names{"RANK", "WORLD_SIZE"}, Names{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
                             Names{"PMI_RANK", "PMI_SIZE"}, Names{"PMIX_RANK", nullptr}}) {
    std::optional<int> rank = int_variable_at_least(lookup, names.rank, 0);
    std::optional<int> size = names.size ? int_variable_at_least(lookup, names.size, 1) : std::nullopt;
    if (!rank && !size) continue;
    MN_CHECK(rank && (size || names.size == nullptr), ValueError, "environment variable ",
             rank ? names.size : names.rank, " is not set, but ", rank ? names.rank : names.size,
             " is: set both (or neither, under mpirun)");
    MN_CHECK(!size || *rank < *size, ValueError, "environment variable ", names.rank, "=", *rank,
             " must be less than ", names.size, "=", *size);
    env.rank = rank;
    env.world_size = size;
    env.rank_source = names.rank;
    break;
  }
  for (const Names& names : {Names{"LOCAL_RANK", "LOCAL_WORLD_SIZE"},
                             Names{"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}}) {
    env.local_rank = int_variable_at_least(lookup, names.rank, 0);
    env.local_world_size = int_variable_at_least(lookup, names.size, 1);
    if (env.local_rank || env.local_world_size) break;
  }
  return env;
}

MpiLaunchEnv from_mpi_env() { return parse_mpi_env(process_variable); }

}  // namespace mn::dist
