#pragma once
// The variables a launcher (mn-run, torchrun) sets for each process:
//   RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT   required
//   LOCAL_RANK                                    optional (defaults to RANK: one machine)
//   LOCAL_WORLD_SIZE                              optional (defaults to WORLD_SIZE)
//   GROUP_RANK, GROUP_WORLD_SIZE                  the node's rank and the number of nodes (informational)
// and, as torchrun's elastic agent does, for the store (see AgentStore below):
//   TORCHELASTIC_USE_AGENT_STORE=True             the launcher serves the TcpStore at MASTER_ADDR:MASTER_PORT
//   TORCHELASTIC_RESTART_COUNT                    how often the launcher has restarted the ranks (0 at first)
//   TORCHELASTIC_MAX_RESTARTS                     the launcher's --max-restarts (informational)
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

// Where a rank's TcpStore lives. mn-run (like torchrun) serves the store from node 0's launcher for the
// whole job, so it survives restarts of the ranks; it tells the ranks with TORCHELASTIC_USE_AGENT_STORE=True.
// setup_ddp (env://) then connects rank 0 as a client too (it does not bind MASTER_PORT) and puts its keys
// under prefix(), so the rendezvous of a restarted attempt never sees the keys of an earlier one. Without
// the variable rank 0 serves the store itself, from a thread, as before.
struct AgentStore {
  bool used = false;      // TORCHELASTIC_USE_AGENT_STORE is True (also accepted: true, 1)
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT (0 when unset)
  // torch's namespace for an attempt's keys: "/worker/attempt_<restart_count>".
  std::string prefix() const;
};
AgentStore agent_store_from_env();
AgentStore parse_agent_store(const std::function<std::optional<std::string>(const std::string&)>& lookup);

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
