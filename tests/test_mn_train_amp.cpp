// mn-train --amp (issue 23) end to end (a small MLP, direct, 640 Fashion-MNIST images, batch 64): the
// option is recorded in the checkpoint's config with the gradient scaler's state (f16; direct and mapped
// checkpoints), --resume takes it from there and refuses another value, and values other than bf16/f16
// are refused. The binary and
// the data are looked up as in test_mn_train.cpp; the case is skipped with a message when either is
// missing.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "nn/safetensors.h"
#include "tests/checkpoint_run_support.h"
#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

using namespace mn;
using json = nlohmann::json;
using mn::testing::CommandResult;
using mn::testing::TempDir;

TEST_CASE("mn-train --amp: recorded with the scaler's state, restored by --resume, other values refused") {
  std::string exe;
  if (!mn::testing::mn_train_ready(exe)) return;
  TempDir dir("mn_train_amp");
  const std::string out = dir / "run";
  const std::string common = "--target mlp --mlp-hidden 32 --strategy direct --batch-size 64 --seed 3 --limit 640";
  const CommandResult first = mn::testing::run_command(str(exe, " ", common, " --epochs 1 --amp f16 --out ", out));
  INFO(first.all());
  REQUIRE(first.status == 0);
  const std::string checkpoint = out + "/checkpoint.safetensors";
  CHECK(json::parse(safetensors::load(checkpoint).metadata.at("config")).at("amp") == "f16");
  // Ten clean steps (no overflow at this size): the scale is still 2^16, the growth count 10.
  const json scaler = mn::testing::checkpoint_trainer_state(checkpoint).at("grad_scaler");
  CHECK(scaler.at("scale") == 65536.0);
  CHECK(scaler.at("_growth_tracker") == 10.0);
  CHECK(scaler.at("growth_interval") == 2000.0);

  const CommandResult other = mn::testing::run_command(str(exe, " --out ", out, " --resume --amp bf16 --epochs 2"));
  CHECK(other.status != 0);
  CHECK(other.err.find("--amp: the run has \"f16\", the command line \"bf16\"") != std::string::npos);

  const CommandResult resumed = mn::testing::run_command(str(exe, " --out ", out, " --resume --epochs 2"));
  INFO(resumed.all());
  REQUIRE(resumed.status == 0);
  CHECK(mn::testing::checkpoint_trainer_state(checkpoint).at("grad_scaler").at("_growth_tracker") == 20.0);

  // A mapped run: the scaler's state travels in the mapping checkpoint's trainer state.
  const std::string mapped = dir / "mapped";
  const CommandResult layerwise = mn::testing::run_command(
      str(exe, " --target mlp --mlp-hidden 32 --strategy layerwise --latent-dim 16 --batch-size 64 --seed 3 "
               "--limit 640 --epochs 1 --amp f16 --out ", mapped));
  INFO(layerwise.all());
  REQUIRE(layerwise.status == 0);
  const std::string mapped_checkpoint = mapped + "/checkpoint.safetensors";
  CHECK(mn::testing::checkpoint_trainer_state(mapped_checkpoint).at("grad_scaler").at("_growth_tracker") == 10.0);
  REQUIRE(mn::testing::run_command(str(exe, " --out ", mapped, " --resume --epochs 2")).status == 0);
  CHECK(mn::testing::checkpoint_trainer_state(mapped_checkpoint).at("grad_scaler").at("_growth_tracker") == 20.0);

  const CommandResult bad = mn::testing::run_command(str(exe, " ", common, " --amp fp16 --out ", dir / "bad"));
  CHECK(bad.status != 0);
  CHECK(bad.all().find("--amp") != std::string::npos);
}
