// The launcher variables of MPI jobs (dist/env.h parse_mpi_env) and launch_env's choice per backend. No MPI
// is initialised here: the MPI process group itself runs under mpirun in tests/dist (label dist).
#include <cstdlib>
#include <map>

#include "dist/env.h"
#include "dist/process_group.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::dist;
using mn::testing::contains;
using mn::testing::error_message;

namespace {

MpiLaunchEnv parse(const std::map<std::string, std::string>& vars) {
  return parse_mpi_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// Sets environment variables for a scope and restores what was there.
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name.c_str());
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value)
        setenv(name.c_str(), value->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

}  // namespace

TEST_CASE("parse_mpi_env: RANK / WORLD_SIZE first, then Open MPI's, PMI's and PMIx's variables") {
  const MpiLaunchEnv none = parse({});
  CHECK_FALSE(none.rank.has_value());
  CHECK_FALSE(none.world_size.has_value());
  CHECK_FALSE(none.local_rank.has_value());
  CHECK(none.rank_source.empty());

  const MpiLaunchEnv ompi = parse({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}});
  CHECK(ompi.rank == 2);
  CHECK(ompi.world_size == 3);
  CHECK(ompi.local_rank == 0);
  CHECK(ompi.local_world_size == 1);
  CHECK(ompi.rank_source == "OMPI_COMM_WORLD_RANK");

  const MpiLaunchEnv both = parse({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                   {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                   {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  CHECK(both.rank == 1);
  CHECK(both.world_size == 4);
  CHECK(both.local_rank == 1);
  CHECK_FALSE(both.local_world_size.has_value());
  CHECK(both.rank_source == "RANK");

  const MpiLaunchEnv pmi = parse({{"PMI_RANK", "3"}, {"PMI_SIZE", "8"}});
  CHECK(pmi.rank == 3);
  CHECK(pmi.world_size == 8);

  const MpiLaunchEnv pmix = parse({{"PMIX_RANK", "5"}});  // the rank only: launch_env asks MPI for the size
  CHECK(pmix.rank == 5);
  CHECK_FALSE(pmix.world_size.has_value());
  CHECK(pmix.rank_source == "PMIX_RANK");
}

TEST_CASE("parse_mpi_env: half-set and malformed variables are errors naming them") {
  CHECK(error_message([] { parse({{"RANK", "0"}}); }) ==
        "environment variable WORLD_SIZE is not set, but RANK is: set both (or neither, under mpirun)");
  CHECK(error_message([] { parse({{"OMPI_COMM_WORLD_SIZE", "2"}}); }) ==
        "environment variable OMPI_COMM_WORLD_RANK is not set, but OMPI_COMM_WORLD_SIZE is: set both (or neither, "
        "under mpirun)");
  CHECK(error_message([] { parse({{"RANK", "x"}, {"WORLD_SIZE", "2"}}); }) ==
        "environment variable RANK='x' is not a non-negative integer");
  CHECK(error_message([] { parse({{"RANK", "0"}, {"WORLD_SIZE", "0"}}); }) ==
        "environment variable WORLD_SIZE='0' is not a positive integer");
  CHECK(error_message([] { parse({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "2"}}); }) ==
        "environment variable OMPI_COMM_WORLD_RANK=2 must be less than OMPI_COMM_WORLD_SIZE=2");
  CHECK_THROWS_AS(parse({{"OMPI_COMM_WORLD_LOCAL_RANK", "-1"}}), ValueError);
}

TEST_CASE("launch_env: mpi needs no MASTER_ADDR / MASTER_PORT; the other backends do") {
  ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                 {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  if (is_backend_available("mpi")) {
    unsetenv("RANK");  // ctest's environment has none; a launcher's would win
    unsetenv("WORLD_SIZE");
    unsetenv("LOCAL_RANK");
    unsetenv("LOCAL_WORLD_SIZE");
    const EnvConfig config = launch_env("mpi");  // both given: MPI is not initialised
    CHECK(config.rank == 1);
    CHECK(config.world_size == 2);
    CHECK(config.local_rank == 1);
    CHECK(config.local_world_size == 2);
    CHECK(config.master_addr.empty());
  } else {
    CHECK(contains(error_message([] { launch_env("mpi"); }), "backend 'mpi' is not available in this build"));
  }
  ScopedEnv no_master({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  unsetenv("MASTER_ADDR");
  CHECK(contains(error_message([] { launch_env("gloo"); }), "environment variable MASTER_ADDR is not set"));
}
