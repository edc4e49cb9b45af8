// The checkpoint fuzzer's seeds (tests/fuzz/corpus_checkpoint) must stay real checkpoints of the
// setups fuzz_checkpoint.cpp builds: if a format or model change made them fail a compatibility
// check, the fuzzer would only ever mutate refused files and never reach the optimizer step. Run by
// mn_unit_tests, so the sanitizer job also trains on each seed. When this fails after an intended
// change, rewrite the seeds (README, Tests).
#include <filesystem>
#include <string>
#include <vector>

#include "tests/fuzz/checkpoint_setup.h"
#include "tests/test_support.h"

using namespace mn;

TEST_CASE("fuzz seeds: every checkpoint seed loads into the setup it names and trains one step") {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(MN_FUZZ_CHECKPOINT_CORPUS))
    files.push_back(entry.path().string());
  REQUIRE(files.size() >= 5);
  int with_optimizer_state = 0;
  for (const std::string& path : files) {
    INFO(path);
    const mapping::CheckpointInfo info = mapping::read_checkpoint(path);
    auto run = fuzz::make_checkpoint_run(fuzz::setup_for(info));
    REQUIRE_NOTHROW(mapping::load_checkpoint(path, *run->model, run->trainer.get()));
    if (info.trainer_state && !info.trainer_state->optimizer.empty()) ++with_optimizer_state;
    const int64_t steps = run->trainer->optimizer().step_count();
    REQUIRE_NOTHROW(run->trainer->fit_epoch(*run->loader));
    CHECK(run->trainer->optimizer().step_count() == steps + 1);
  }
  CHECK(with_optimizer_state >= 4);
}
