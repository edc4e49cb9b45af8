#pragma once
// The variables a launcher (mn-run, torchrun) sets for each process:
//   RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT   required
//   LOCAL_RANK                                    optional (defaults to RANK: one machine)
//   LOCAL_WORLD_SIZE                              optional (defaults to WORLD_SIZE)
// A missing or malformed variable is a ValueError naming it and what it held.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace mn::dist {

struct EnvConfig {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
};

// Reads the process environment.
EnvConfig from_env();
// The same rules over any lookup (tests use a map); `lookup` returns nullopt for an unset variable.
EnvConfig parse_env(const std::function<std::optional<std::string>(const std::string&)>& lookup);

// Parsers behind from_env, for other variables. `name` appears in the errors.
int64_t parse_int_variable(const std::string& name, const std::string& text);
uint16_t parse_port_variable(const std::string& name, const std::string& text);

}  // namespace mn::dist
