// End to end: the mn-paper example (the paper's tables as mn-train runs). Most cases drive it with a
// stand-in mn-train (a shell script, --mn-train) that logs its command lines and prints a JSON summary,
// rejects --rank as an unknown flag (CLI11's exit code 109) and fails on --prune, so the cases do not
// depend on which flags the real mn-train has; one case runs the real mn-train on 200 images.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/mn_train_exe.h"
#include "tests/run_command.h"
#include "tests/temp_dir.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using mn::testing::CommandResult;
using mn::testing::TempDir;

namespace {

std::string mn_paper_exe() {
  const std::string train = mn::testing::mn_train_exe();
  if (train.empty()) return "";
  const fs::path paper = fs::path(train).parent_path() / "mn-paper";
  return fs::exists(paper) ? paper.string() : "";
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The stand-in: logs "$@" to LOG, then rejects --rank, fails on --prune, or prints a summary whose test
// accuracy is 0.5 + seed / 100 with --epochs epochs and 2,688 trainable parameters, touching a checkpoint.
std::string write_fake(const TempDir& dir) {
  const std::string path = dir / "fake-mn-train", log = dir / "calls.log";
  std::ofstream(path) << "#!/bin/sh\n"
                      << "echo \"$*\" >> '" << log << "'\n"
                      << "case \" $* \" in\n"
                      << "  *' --rank '*) echo 'The following arguments were not expected: --rank 32' >&2;"
                         " echo 'Run with --help for more information.' >&2; exit 109;;\n"
                      << "  *' --prune '*) echo 'mn-train: warning: ignore me' >&2; echo 'mn-train: pruning broke' >&2;"
                         " exit 1;;\n"
                      << "esac\n"
                      << "while [ $# -gt 0 ]; do case \"$1\" in --seed) seed=$2;; --epochs) epochs=$2;;"
                         " --out) out=$2;; esac; shift; done\n"
                      << "mkdir -p \"$out\" && touch \"$out/checkpoint.safetensors\"\n"
                      << "echo 'epoch 1 done'\n"
                      << "echo \"{\\\"test_accuracy\\\": 0.5$seed, \\\"trainable_params\\\": 2688, \\\"epochs\\\": $epochs,"
                         " \\\"seconds\\\": 1.5}\"\n";
  ::chmod(path.c_str(), 0755);
  return path;
}

bool ready(std::string& exe) {
  exe = mn_paper_exe();
  if (exe.empty()) MESSAGE("skipped: mn-paper not built next to the tests (build target mn-paper)");
  return !exe.empty();
}

const json& row(const json& report, const std::string& id) {
  for (const json& r : report["rows"])
    if (r["id"] == id) return r;
  FAIL("no row " << id);
  static const json none;
  return none;
}

}  // namespace

TEST_CASE("mn-paper --dry-run lists one mn-train command per configuration and seed") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_paper");
  const CommandResult r = mn::testing::run_command(exe + " --dry-run --tables 8 --seeds 0,1 --epochs 3 --mn-train /x/mn-train --out " +
                                                   dir.path().string());
  INFO(r.all());
  REQUIRE(r.status == 0);
  const auto lines = mn::testing::nonempty_lines(r.out);
  CHECK(lines.size() == 9 * 2);  // Table 8's nine configurations, two seeds
  const std::string base = " --seed 0 --epochs 3 --out ";
  CHECK(count(r.out, "/x/mn-train --target cnn2 --strategy direct --rank 32" + base) == 1);
  CHECK(count(r.out, "/x/mn-train --target cnn2 --strategy direct --prune 0.9" + base) == 1);
  // Mapped rows train with --mapped-args (default: the README's CNN2 settings); direct rows do not.
  const std::string mapped = " --batch-size 256 --scheduler cosine --seed ";
  CHECK(count(r.out, "--target cnn2 --strategy lrd --latent-dim 364 --rank 32 --mapping-loss" + mapped + "1") == 1);
  CHECK(count(r.out, "--target cnn2 --strategy lrd --latent-dim 672 --rank 32 --mapping-loss" + mapped + "0") == 1);
  CHECK(count(r.out, "--strategy slvt --latent-dim 2048 --prune 0.9 --mapping-loss" + mapped + "0") == 1);
  CHECK(count(r.out, "--strategy layerwise --latent-dim 672 --prune 0.9 --mapping-loss" + mapped + "1") == 1);
  CHECK(count(r.out, "--scheduler cosine") == 12);  // 6 of the 9 configurations are mapped, two seeds
  CHECK(count(r.out, " --json") == 18);
  CHECK(!fs::exists(dir.path() / "runs"));  // a dry run starts nothing
  // --mapped-args '' leaves mn-train's own defaults.
  const CommandResult plain = mn::testing::run_command(exe + " --dry-run --tables 8 --seeds 1 --mapped-args '' --out " +
                                                       dir.path().string());
  REQUIRE(plain.status == 0);
  CHECK(count(plain.out, "--strategy lrd --latent-dim 364 --rank 32 --mapping-loss --seed 0 --epochs 10 ") == 1);
  CHECK(count(plain.out, "--scheduler") == 0);

  // Tables 1 and 8 share CNN2's direct, SLVT 2,048 and LWT 2,688 runs; --quick sets 1 epoch and 2,000 images;
  // --mapper reaches the mapped rows only; Table 7's trainable-map rows are listed as not run.
  const CommandResult both = mn::testing::run_command(exe + " --dry-run --quick --tables 1,7,8 --mapper srht --out " +
                                                      dir.path().string());
  REQUIRE(both.status == 0);
  CHECK(count(both.out, "--target cnn2 --strategy direct --limit 2000 --seed 0 --epochs 1 ") == 1);
  CHECK(count(both.out, "--target cnn2 --strategy layerwise --latent-dim 672 --mapping-loss --mapper srht --batch-size 256 "
                        "--scheduler cosine --limit 2000") == 1);
  CHECK(count(both.out, "--target cnn1 --strategy layerwise --latent-dim 680 ") == 1);
  CHECK(count(both.out, "--alpha 0 --mapper srht") == 2);
  CHECK(count(both.out, "# t7:full-dnn: not run: needs a trainable map") == 1);
  CHECK(count(both.out, "# t7:lv-wmap-4096: not run:") == 1);
  // 9 (Table 1) + 2 (Table 7's no-modulation rows) + 6 (Table 8's others) runs, 5 rows not run.
  CHECK(mn::testing::nonempty_lines(both.out).size() == 9 + 2 + 6 + 5);

  CHECK(mn::testing::run_command(exe + " --dry-run --tables 2").status == 2);
  CHECK(mn::testing::run_command(exe + " --dry-run --rows 'no such row'").status == 2);
  CHECK(mn::testing::run_command(exe + " --dry-run --seeds 0").status != 0);
}

TEST_CASE("mn-paper reports a row this mn-train rejects as unavailable, runs the others, and reuses finished runs") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_paper");
  const std::string fake = write_fake(dir);
  const std::string out = (dir.path() / "out").string();
  const auto command = [&](const std::string& rows, int epochs) {
    return exe + " --tables 8 --rows '" + rows + "' --seeds 0,1 --epochs " + std::to_string(epochs) + " --mn-train " +
           fake + " --out " + out;
  };
  const std::string all = "cnn2-direct$|lrd|lwt-2688$";
  const CommandResult r = mn::testing::run_command(command(all, 1));
  INFO(r.all());
  REQUIRE(r.status == 0);  // unavailable rows are not failures
  const json report = json::parse(read_text(fs::path(out) / "paper.json"));
  REQUIRE(report["rows"].size() == 5);
  const json& direct = row(report, "t8:cnn2-direct");
  CHECK(direct["status"] == "ok");
  CHECK(direct["accuracies"] == json::array({50.0, 51.0}));
  CHECK(direct["mean"].get<double>() == doctest::Approx(50.5));
  CHECK(direct["std"].get<double>() == doctest::Approx(0.70710678));
  CHECK(direct["trainable_params"] == 2688);
  CHECK(direct["params_match"] == false);  // the stand-in's count is not CNN2's 108,618
  CHECK(row(report, "t8:cnn2-lwt-2688")["params_match"] == true);
  for (const char* id : {"t8:cnn2-direct-lrd", "t8:cnn2-slvt-lrd-1456", "t8:cnn2-lwt-2688-lrd"}) {
    INFO(id);
    CHECK(row(report, id)["status"] == "unavailable: The following arguments were not expected: --rank 32");
    CHECK(row(report, id)["accuracies"].empty());
  }
  const std::string md = read_text(fs::path(out) / "paper.md");
  CHECK(md.find("| table | row | id | trainable (ours) | paper # params | ours: test acc % (mean ± std) | min–max | "
                "seeds | epochs | paper | public reimpl. | status / note |") != std::string::npos);
  CHECK(md.find("| 8 | CNN2 | `t8:cnn2-direct` | 2,688 ≠ | 108,618 | 50.50 ± 0.71 | 50.00–51.00 | 2 | 1 | 90.40 |") !=
        std::string::npos);
  CHECK(count(md, "unavailable: The following arguments were not expected: --rank 32") == 3);
  CHECK(r.out == md);  // the same table on stdout
  // Seed 1 of a rejected configuration is not tried: 2 x 2 runs + 3 rejected.
  std::string calls = read_text(dir / "calls.log");
  CHECK(mn::testing::nonempty_lines(calls).size() == 7);

  // Again: the finished runs are reused (only the rejected ones are tried again), and the table is the same.
  const CommandResult again = mn::testing::run_command(command(all, 1));
  REQUIRE(again.status == 0);
  calls = read_text(dir / "calls.log");
  CHECK(mn::testing::nonempty_lines(calls).size() == 10);
  CHECK(count(calls, "--rank") == 6);
  CHECK(json::parse(read_text(fs::path(out) / "paper.json"))["rows"] == report["rows"]);

  // More epochs continue the finished runs from their checkpoints; fewer are refused.
  const CommandResult longer = mn::testing::run_command(command("lwt-2688$", 2));
  REQUIRE(longer.status == 0);
  calls = read_text(dir / "calls.log");
  CHECK(count(calls, "--epochs 2 --out " + out) == 2);
  CHECK(count(calls, "--resume") == 2);
  const CommandResult shorter = mn::testing::run_command(command("lwt-2688$", 1));
  CHECK(shorter.status == 1);
  CHECK(shorter.out.find("holds 2 epochs, more than --epochs 1") != std::string::npos);
}

TEST_CASE("mn-paper reports a failed run with its first error line and exits 1") {
  std::string exe;
  if (!ready(exe)) return;
  TempDir dir("mn_paper");
  const std::string fake = write_fake(dir);
  const CommandResult r = mn::testing::run_command(exe + " --tables 8 --rows 'cnn2-direct(-prune)?$' --mn-train " + fake +
                                                   " --out " + (dir.path() / "out").string());
  INFO(r.all());
  CHECK(r.status == 1);
  const json report = json::parse(read_text(dir.path() / "out" / "paper.json"));
  CHECK(row(report, "t8:cnn2-direct-prune")["status"] == "failed: mn-train: pruning broke");
  CHECK(row(report, "t8:cnn2-direct")["status"] == "ok");
}

TEST_CASE("mn-paper --quick with the real mn-train writes the table as Markdown and JSON") {
  std::string exe, train;
  if (!ready(exe) || !mn::testing::mn_train_ready(train)) return;
  TempDir dir("mn_paper");
  const fs::path out = dir.path() / "out";
  const CommandResult r = mn::testing::run_command(exe + " --quick --limit 200 --tables 1 --rows 't1:cnn2-(direct|lwt-2688)$' "
                                                   "--threads 1 --out " + out.string());
  INFO(r.all());
  REQUIRE(r.status == 0);
  const json report = json::parse(read_text(out / "paper.json"));
  for (const char* key : {"command", "mn_train", "epochs", "limit", "seeds", "wall_seconds", "rows"}) CHECK(report.contains(key));
  REQUIRE(report["rows"].size() == 2);
  for (const json& r : report["rows"]) {
    INFO(r.dump());
    CHECK(r["status"] == "ok");
    CHECK(r["epochs"] == 1);
    CHECK(r["params_match"] == true);
    CHECK(r["accuracies"].size() == 1);
    CHECK(r["mean"].get<double>() > 0);
    CHECK(r["mean"].get<double>() <= 100);
  }
  CHECK(row(report, "t1:cnn2-direct")["trainable_params"] == 108618);
  CHECK(row(report, "t1:cnn2-lwt-2688")["trainable_params"] == 2688);
  CHECK(row(report, "t1:cnn2-lwt-2688")["reimplementation"] == 87.38);
  const std::string md = read_text(out / "paper.md");
  CHECK(count(md, "| 1 | CNN2 ") == 2);
  CHECK(md.find("| 93.35 | 87.38 |") != std::string::npos);
  CHECK(fs::exists(out / "runs" / "target-cnn2_strategy-direct_limit-200" / "seed-0" / "result.json"));
  CHECK(fs::exists(out / "runs" / "target-cnn2_strategy-direct_limit-200" / "seed-0" / "metrics.csv"));
}
