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

// ---- processes started by an MPI launcher (backend "mpi"): no MASTER_ADDR / MASTER_PORT ----
// Rank and size, in this order of preference: RANK / WORLD_SIZE (both, when either is set); Open MPI's
// OMPI_COMM_WORLD_RANK / OMPI_COMM_WORLD_SIZE (mpirun); PMI_RANK / PMI_SIZE (MPICH's and Slurm's PMI);
// PMIx's PMIX_RANK, which gives the rank only. The local rank and size likewise from LOCAL_RANK /
// LOCAL_WORLD_SIZE, else OMPI_COMM_WORLD_LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_SIZE. What no variable gives
// stays empty (launch_env in dist/process_group.h then asks MPI). Malformed values are ValueErrors naming
// the variable, as from_env's.
struct MpiLaunchEnv {
  std::optional<int> rank, world_size, local_rank, local_world_size;
  std::string rank_source;  // the variable the rank came from ("" when none)
};
MpiLaunchEnv parse_mpi_env(const std::function<std::optional<std::string>(const std::string&)>& lookup);
MpiLaunchEnv from_mpi_env();

}  // namespace mn::dist
