// Built-in targets (mapping/targets.h): the paper's architectures with their exact parameter counts.
#include "mapping/generator.h"
#include "mapping/targets.h"
#include "tests/test_support.h"

using namespace mn;
using namespace mn::mapping;

TEST_CASE("targets: the built-in targets have the paper's parameter counts") {
  manual_seed(0);
  CHECK(target_spec("cnn2").total_numel() == 108618);
  CHECK(target_spec("cnn1").total_numel() == 537994);
  CHECK(target_spec("mlp").total_numel() == 269322);
  CHECK(target_spec("lenet").total_numel() == 61706);
  CHECK(layerwise_groups(target_spec("cnn2")).size() == 4);
  CHECK(layerwise_groups(target_spec("cnn1")).size() == 6);
  CHECK(target_spec("mlp", {{1024, 1024}}).total_numel() == 1863690);
  CHECK_THROWS_WITH_AS(make_target("resnet"), doctest::Contains("cnn1, cnn2, mlp, lenet"), ValueError);
  CHECK_THROWS_WITH_AS(target_spec("resnet"), doctest::Contains("guide"), ValueError);
  // Every runnable target classifies 1x28x28 images into 10 classes.
  for (const auto& name : target_names()) {
    INFO(name);
    auto net = make_target(name);
    CHECK(net->forward(zeros({2, 1, 28, 28})).sizes() == Shape{2, 10});
  }
}
