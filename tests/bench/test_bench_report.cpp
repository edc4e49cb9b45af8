// mn_bench_report (the summary `./mn bench` prints) on small synthetic results in tests/data/bench:
// the tables read the descriptive benchmark names (and the positional ones of older results), intended
// skips are listed as skipped, --compare gives new / old per figure and flags the worse ones, the
// chart is a well-formed SVG with one bar per value, and the shared-machine rows carry ok/OVER.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../run_command.h"
#include "../temp_dir.h"

namespace fs = std::filesystem;
using nlohmann::json;
using mn::testing::run_command;
using mn::testing::TempDir;

namespace {

const fs::path kData = MN_BENCH_TEST_DATA;

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

// The fixture results copied into `dir`.
void copy_results(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(kData / "results")) fs::copy_file(e.path(), dir / e.path().filename());
}

mn::testing::CommandResult report(const fs::path& dir, const std::string& options = "") {
  return run_command(std::string("'") + MN_BENCH_REPORT + "' '" + dir.string() + "' " + options);
}

// Writes each program's benchmark rows as DIR/<program>.json (on a 2-CPU machine) and runs the report
// on DIR without the chart.
mn::testing::CommandResult report_rows(const fs::path& dir,
                                       const std::vector<std::pair<std::string, std::vector<json>>>& programs) {
  for (const auto& [program, rows] : programs)
    write_text(dir / (program + ".json"), json{{"context", {{"num_cpus", 2}}}, {"benchmarks", rows}}.dump());
  return report(dir, "--no-chart");
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

// One Google Benchmark result row as its JSON output writes it: an iteration of `name` with these
// counters.
json iteration_row(const std::string& name, const json& counters, double real_time_ms = 1.0) {
  json r = {{"name", name},         {"run_name", name},  {"run_type", "iteration"}, {"repetitions", 1},
            {"repetition_index", 0}, {"iterations", 1}, {"real_time", real_time_ms}, {"cpu_time", 1.0},
            {"time_unit", "ms"}};
  r.update(counters);
  return r;
}

const json* find_row(const json& rows, const std::string& key, const std::string& value,
                     const std::string& key2 = "", const json& value2 = nullptr) {
  for (const json& r : rows)
    if (r.value(key, std::string()) == value && (key2.empty() || r[key2] == value2)) return &r;
  return nullptr;
}

// Checks that `text` is well-formed XML in the subset an SVG writer uses: elements properly nested
// with one root, attributes quoted, no '<' or bare '&' in text or attribute values. Returns "" or
// what is wrong; counts the elements by name and by class attribute.
std::string check_xml(const std::string& text, std::map<std::string, int>& elements, std::map<std::string, int>& classes) {
  std::vector<std::string> open;
  int roots = 0;
  size_t i = 0;
  auto bad_ampersand = [](const std::string& s) {
    static const std::regex entity("^&(amp|lt|gt|quot|apos|#[0-9]+);");
    for (size_t k = s.find('&'); k != std::string::npos; k = s.find('&', k + 1))
      if (!std::regex_search(s.substr(k, 8), entity)) return true;
    return false;
  };
  while (i < text.size()) {
    const size_t lt = text.find('<', i);
    const std::string between = text.substr(i, lt == std::string::npos ? std::string::npos : lt - i);
    if (bad_ampersand(between)) return "a bare '&' in text: " + between;
    if (open.empty() && between.find_first_not_of(" \n\t\r") != std::string::npos) return "text outside the root";
    if (lt == std::string::npos) break;
    const size_t gt = text.find('>', lt);
    if (gt == std::string::npos) return "a tag that is not closed";
    std::string tag = text.substr(lt + 1, gt - lt - 1);
    i = gt + 1;
    if (tag.rfind("?", 0) == 0 || tag.rfind("!--", 0) == 0) continue;
    if (tag.rfind("/", 0) == 0) {
      if (open.empty() || open.back() != tag.substr(1)) return "</" + tag.substr(1) + "> closes nothing open";
      open.pop_back();
      continue;
    }
    const bool self_closing = !tag.empty() && tag.back() == '/';
    if (self_closing) tag.pop_back();
    std::istringstream in(tag);
    std::string name;
    in >> name;
    if (name.empty() || tag.find('<') != std::string::npos) return "a malformed tag: <" + tag + ">";
    // Attributes: name="value" pairs separated by spaces.
    static const std::regex attribute(R"re(\s*([A-Za-z_:][-A-Za-z0-9_:.]*)="([^"<]*)"\s*)re");
    std::string rest = tag.substr(name.size());
    std::smatch m;
    while (std::regex_search(rest, m, attribute, std::regex_constants::match_continuous)) {
      if (bad_ampersand(m[2].str())) return "a bare '&' in an attribute of <" + name + ">";
      if (m[1].str() == "class") ++classes[m[2].str()];
      rest = m.suffix().str();
    }
    if (rest.find_first_not_of(" \n\t") != std::string::npos) return "attributes not name=\"value\": <" + tag + ">";
    ++elements[name];
    if (open.empty() && ++roots > 1) return "more than one root element";
    if (!self_closing) open.push_back(name);
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  return roots == 1 ? "" : "no root element";
}

}  // namespace

TEST_CASE("bench report: tables from descriptive names, intended skips listed as skipped") {
  TempDir dir("mn_bench_report");
  copy_results(dir.path());
  const auto r = report(dir.path(), "--no-chart");
  INFO(r.all());
  REQUIRE(r.status == 0);
  // The generator table: one line per spec, L and strategy, the refused configuration as skipped.
  CHECK(std::regex_search(r.out, std::regex(R"(guide\s+64\s+76,938\s+slvt\s+2\.00 ms\s+5\.00 ms\s+617,984\s+1,233,920)")));
  CHECK(std::regex_search(r.out, std::regex(R"(cnn2\s+1024\s+slvt\s+skipped: fixed projection would contain 111,224,832 elements\n)")));
  CHECK(std::regex_search(r.out, std::regex(R"(cnn2\s+1024\s+108,618\s+lazy_layerwise\s+25\.00 ms\s+45\.00 ms)")));
  CHECK(r.out.find("peak ordering holds in 2 of 2 configurations") != std::string::npos);
  // The allocator table reads the named arguments (bytes:64, segments:16).
  CHECK(std::regex_search(r.out, std::regex(R"(cached small hit, 64 B \(target <= 100 ns\)\s+50\.0 ns)")));
  CHECK(std::regex_search(r.out, std::regex(R"(empty_cache, 16 cached 12 MiB segments\s+180\.00 us)")));
  CHECK(r.out.find("cached 64 MiB is 100x faster than malloc") != std::string::npos);
  // Ours against PyTorch, from compare_torch.json.
  CHECK(std::regex_search(r.out, std::regex(R"(CNN2 direct, batch 128, Adam\s+8\.00\s+torch\s+10\.00\s+0\.80)")));
  CHECK(std::regex_search(r.out, std::regex(R"(MLP direct, batch 64 \(ours not built\)\s+n/a\s+torch\s+1\.00\s+n/a\n)")));
  CHECK(r.out.find("ERROR") == std::string::npos);
  CHECK_FALSE(fs::exists(dir.path() / "summary.svg"));

  const json s = read_json(dir.path() / "summary.json");
  const json& rows = s["generators"]["rows"];
  REQUIRE(rows.size() == 6);
  const json* slvt = find_row(rows, "strategy", "slvt", "spec", "guide");
  REQUIRE(slvt != nullptr);
  CHECK((*slvt)["generate_ms"].get<double>() == doctest::Approx(2.0));
  CHECK((*slvt)["peak_bytes"].get<double>() == 617984);
  const json* refused = find_row(rows, "strategy", "slvt", "spec", "cnn2");
  REQUIRE(refused != nullptr);
  CHECK((*refused)["skipped"].get<std::string>().rfind("skipped: fixed projection", 0) == 0);
  CHECK_FALSE(refused->contains("generate_ms"));
  CHECK(s["allocator"]["small_hit_64B_ns"].get<double>() == doctest::Approx(50));
  CHECK(s["allocator"]["small_hit_4KiB_ns"].get<double>() == doctest::Approx(60));
  CHECK(s["allocator"]["empty_cache_ns"]["16"].get<double>() == doctest::Approx(180000));
  CHECK(s["torch"]["rows"].size() == 3);
}

TEST_CASE("bench report: results with positional arguments (older programs) give the same summary") {
  TempDir named("mn_bench_report"), positional("mn_bench_report");
  copy_results(named.path());
  copy_results(positional.path());
  // What the programs wrote before their arguments were named.
  std::string gen = read_text(kData / "results" / "mn_bench_generators.json");
  for (auto [from, to] : {std::pair{"strategy:slvt/", "strategy:0/"}, {"strategy:layerwise/", "strategy:1/"},
                          {"strategy:lazy_layerwise/", "strategy:2/"}, {"spec:guide/", "spec:0/"}, {"spec:cnn2/", "spec:2/"}})
    gen = std::regex_replace(gen, std::regex(from), to);
  REQUIRE(gen.find("spec:guide") == std::string::npos);
  write_text(positional.path() / "mn_bench_generators.json", gen);
  std::string alloc = read_text(kData / "results" / "mn_bench_allocator.json");
  alloc = std::regex_replace(std::regex_replace(alloc, std::regex("bytes:"), ""), std::regex("segments:"), "");
  write_text(positional.path() / "mn_bench_allocator.json", alloc);
  REQUIRE(report(named.path(), "--no-chart").status == 0);
  REQUIRE(report(positional.path(), "--no-chart").status == 0);
  const json a = read_json(named.path() / "summary.json"), b = read_json(positional.path() / "summary.json");
  CHECK(a["generators"] == b["generators"]);
  CHECK(a["allocator"] == b["allocator"]);
}

TEST_CASE("bench report: --compare prints new / old per figure and flags the worse ones") {
  TempDir dir("mn_bench_report");
  copy_results(dir.path());
  const std::string old = (kData / "old_summary.json").string();
  auto r = report(dir.path(), "--no-chart --compare '" + old + "'");
  INFO(r.all());
  REQUIRE(r.status == 0);
  CHECK(std::regex_search(r.out, std::regex(R"(generate guide L=64 slvt\s+1\.00 ms\s+2\.00 ms\s+2\.000  SLOWER\n)")));
  CHECK(std::regex_search(r.out, std::regex(R"(generate guide L=64 layerwise\s+3\.00 ms\s+3\.00 ms\s+1\.000\n)")));
  CHECK(std::regex_search(r.out, std::regex(R"(generate guide L=64 lazy_layerwise\s+5\.00 ms\s+4\.00 ms\s+0\.800\n)")));
  CHECK(std::regex_search(r.out, std::regex(R"(allocator small_hit_64B_ns\s+40\.0 ns\s+50\.0 ns\s+1\.250  SLOWER\n)")));
  CHECK(std::regex_search(r.out, std::regex(R"(allocator cached_vs_malloc_64MiB\s+200 x\s+100 x\s+0\.500  LOWER\n)")));
  CHECK(r.out.find("11 figures compared, 3 worse by more than 10%") != std::string::npos);
  CHECK(r.out.find("3 only in the old") != std::string::npos);
  json c = read_json(dir.path() / "summary.json")["comparison"];
  CHECK(c["compared"] == 11);
  CHECK(c["worse"] == 3);
  const json* slvt = find_row(c["rows"], "figure", "generate guide L=64 slvt");
  REQUIRE(slvt != nullptr);
  CHECK((*slvt)["ratio"].get<double>() == doctest::Approx(2.0));
  CHECK((*slvt)["worse"] == true);

  // A wider threshold: 1.25 is within +30%, 2.0 and the halved rate are not.
  r = report(dir.path(), "--no-chart --threshold 30 --compare '" + old + "'");
  REQUIRE(r.status == 0);
  CHECK(std::regex_search(r.out, std::regex(R"(allocator small_hit_64B_ns\s+40\.0 ns\s+50\.0 ns\s+1\.250\n)")));
  c = read_json(dir.path() / "summary.json")["comparison"];
  CHECK(c["worse"] == 2);
  CHECK(c["threshold_pct"].get<double>() == 30);

  // The earlier summary may be the one this run replaces: it is read before anything is written.
  fs::copy_file(old, dir.path() / "summary.json", fs::copy_options::overwrite_existing);
  r = report(dir.path(), "--no-chart --compare '" + (dir.path() / "summary.json").string() + "'");
  REQUIRE(r.status == 0);
  CHECK(read_json(dir.path() / "summary.json")["comparison"]["worse"] == 3);
}

TEST_CASE("bench report: the chart is a well-formed SVG with one bar per value") {
  TempDir dir("mn_bench_report");
  copy_results(dir.path());
  auto r = report(dir.path());
  INFO(r.all());
  REQUIRE(r.status == 0);
  const fs::path svg = dir.path() / "summary.svg";
  REQUIRE(fs::exists(svg));
  CHECK(r.out.find("wrote " + svg.string() + " (2 panels, 11 bars)") != std::string::npos);
  const std::string text = read_text(svg);
  std::map<std::string, int> elements, classes;
  CHECK(check_xml(text, elements, classes) == "");
  CHECK(text.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0) == 0);
  // Peaks: 3 strategies at guide L=64, 2 at cnn2 L=1024 (slvt refused); PyTorch: ours + 1, ours + 2,
  // and torch alone where ours is missing.
  CHECK(classes["panel"] == 2);
  CHECK(classes["bar"] == 11);
  CHECK(classes["legend"] == 3 + 4);
  CHECK(elements["title"] == 11);
  CHECK(text.find("MLP &lt;784-256-256-10&gt; &amp; layerwise") != std::string::npos);
  CHECK(text.find("guide L=64, slvt: 618.0 kB") != std::string::npos);

  // --chart elsewhere; the checker itself refuses what is not well-formed.
  const fs::path other = dir.path() / "chart.svg";
  r = report(dir.path(), "--chart '" + other.string() + "'");
  REQUIRE(r.status == 0);
  CHECK(fs::exists(other));
  CHECK(check_xml("<svg><g></svg>", elements, classes) != "");
  CHECK(check_xml("<svg><text>a & b</text></svg>", elements, classes) != "");
  CHECK(check_xml("<svg x=1></svg>", elements, classes) != "");
}

TEST_CASE("bench report: bad arguments are refused with a message") {
  TempDir dir("mn_bench_report");
  copy_results(dir.path());
  auto r = report(dir.path(), "--threshold -5 --compare x");
  CHECK(r.status == 2);
  CHECK(r.err.find("--threshold needs a percentage >= 0 (e.g. 10), got '-5'") != std::string::npos);
  r = report(dir.path(), "--compare '" + (dir.path() / "missing.json").string() + "'");
  CHECK(r.status == 1);
  CHECK(r.err.find("cannot read --compare file") != std::string::npos);
  write_text(dir.path() / "not_a_summary.json", "[1, 2]");
  r = report(dir.path(), "--compare '" + (dir.path() / "not_a_summary.json").string() + "'");
  CHECK(r.status == 1);
  CHECK(r.err.find("is not a summary.json (expected an object)") != std::string::npos);
  r = report(dir.path(), "--frobnicate");
  CHECK(r.status == 2);
  CHECK(r.err.find("unknown option '--frobnicate'") != std::string::npos);
  r = report(dir.path(), "--chart a.svg --no-chart");
  CHECK(r.status == 2);
}

TEST_CASE("bench report: the contention rows give default / best under load (means) and idle default / static") {
  TempDir dir("mn_bench_report");
  // Two targets: one within both targets, one over both (mn_bench_contention's counters). Under load
  // the ratio is of means: the medians given here would pass where the means do not, and the reverse.
  auto run = [](int target, const char* label, double busy_default, double busy_t1, double idle_default) {
    return iteration_row("BM_Contention/target:" + std::to_string(target) + "/iterations:1/manual_time",
                         {{"busy_default_ms", 2 * busy_t1}, {"busy_default_mean_ms", busy_default},
                          {"busy_static_ms", busy_t1 / 2}, {"busy_static_mean_ms", 60.0},
                          {"busy_t1_ms", busy_t1}, {"busy_t1_mean_ms", busy_t1},
                          {"busy_best_ms", busy_t1}, {"busy_ratio", busy_default / busy_t1},
                          {"busy_median_ratio", 4.0}, {"busy_static_ratio", 60.0 / busy_t1},
                          {"idle_default_ms", idle_default}, {"idle_default_mean_ms", 99.0},
                          {"idle_static_ms", 20.0}, {"idle_static_mean_ms", 20.5},
                          {"idle_t1_ms", 31.0}, {"idle_t1_mean_ms", 31.5}, {"idle_ratio", idle_default / 20.0},
                          {"team_idle", 2.0}, {"team_busy", 1.0}, {"cpus", 2.0}, {"load_avg", 1.25}, {"label", label}},
                         1000.0);
  };
  const json results = {{"context", {{"num_cpus", 2}}},
                        {"benchmarks", {run(0, "cnn2 layerwise 4x672 batch 256", 33.0, 32.0, 20.2),
                                        run(1, "mlp layerwise 3x64 batch 64", 45.0, 30.0, 21.0)}}};
  write_text(dir.path() / "mn_bench_contention.json", results.dump());
  const auto r = report(dir.path(), "--no-chart");
  INFO(r.all());
  REQUIRE(r.status == 0);
  // One row per setting (idle median, busy median, busy mean); the _mean_ms counters are no rows.
  CHECK(std::regex_search(r.out, std::regex(R"(default\s+20\.200\s+64\.000\s+33\.000)")));
  CHECK(std::regex_search(r.out, std::regex(R"(t1\s+31\.000\s+32\.000\s+32\.000)")));
  CHECK(r.out.find("default_mean") == std::string::npos);
  CHECK(std::regex_search(r.out, std::regex(R"(one core busy \(means\): cnn2 layerwise 4x672 batch 256\s+1\.03 \(33\.000 / 32\.000 ms\)\s+<= 1\.2\s+ok)")));
  CHECK(std::regex_search(r.out, std::regex(R"(one core busy \(means\): mlp layerwise 3x64 batch 64\s+1\.50 \(45\.000 / 30\.000 ms\)\s+<= 1\.2\s+OVER)")));
  CHECK(std::regex_search(r.out, std::regex(R"(idle \(medians\): cnn2 layerwise 4x672 batch 256\s+1\.010 \(20\.200 / 20\.000 ms\)\s+<= 1\.03\s+ok)")));
  CHECK(std::regex_search(r.out, std::regex(R"(idle \(medians\): mlp layerwise 3x64 batch 64\s+1\.050 \(21\.000 / 20\.000 ms\)\s+<= 1\.03\s+OVER)")));
  const json s = read_json(dir.path() / "summary.json");
  REQUIRE(s["contention"].size() == 2);
  CHECK(s["contention"][1]["busy_ratio"].get<double>() == doctest::Approx(1.5));
  CHECK(s["contention"][1]["busy_median_ratio"].get<double>() == doctest::Approx(4.0));
  CHECK(s["contention"][0]["busy_default_mean_ms"].get<double>() == doctest::Approx(33.0));
  CHECK(s["contention"][0]["idle_static_ms"].get<double>() == doctest::Approx(20.0));
}

TEST_CASE("bench report: the 1-CPU quota rows give default / best by means, and a skipped run says why") {
  TempDir dir("mn_bench_report");
  auto run = [](int target, const char* label, double default_mean, double t1_mean) {
    return iteration_row("BM_Quota/target:" + std::to_string(target) + "/iterations:1/manual_time",
                         {{"quota_default_ms", 9.0}, {"quota_default_mean_ms", default_mean},
                          {"quota_static_ms", 5.0}, {"quota_static_mean_ms", 40.0},
                          {"quota_t1_ms", 9.5}, {"quota_t1_mean_ms", t1_mean}, {"quota_best_ms", t1_mean},
                          {"quota_ratio", default_mean / t1_mean}, {"quota_median_ratio", 1.8},
                          {"quota_static_ratio", 40.0 / t1_mean}, {"team_quota", 1.0}, {"label", label}},
                         1000.0);
  };
  json skipped = iteration_row("BM_Quota/target:1/iterations:1/manual_time", json::object(), 0.0);
  skipped["error_occurred"] = true;
  skipped["error_message"] = "needs a cgroup to set a CPU quota in: cannot create /x: Permission denied";
  const json results = {{"context", {{"num_cpus", 2}}},
                        {"benchmarks", {run(0, "cnn2 layerwise 4x672 batch 256", 20.0, 19.0), skipped}}};
  write_text(dir.path() / "mn_bench_contention.json", results.dump());
  const auto r = report(dir.path(), "--no-chart");
  INFO(r.all());
  REQUIRE(r.status == 0);
  CHECK(std::regex_search(r.out, std::regex(R"(static\s+5\.000\s+40\.000)")));
  CHECK(std::regex_search(r.out, std::regex(R"(1-CPU cgroup quota \(means\): cnn2 layerwise 4x672 batch 256\s+1\.05 \(20\.000 / 19\.000 ms\)\s+<= 1\.2\s+ok)")));
  CHECK(r.out.find("skipped: needs a cgroup to set a CPU quota in") != std::string::npos);
  const json s = read_json(dir.path() / "summary.json");
  REQUIRE(s["contention"].size() == 1);
  CHECK(s["contention"][0]["quota_ratio"].get<double>() == doctest::Approx(20.0 / 19.0));
  CHECK(s["contention"][0]["quota_t1_mean_ms"].get<double>() == doctest::Approx(19.0));
}

TEST_CASE("bench report: f32 GEMM as a fraction of the FMA peak measured at the same thread count") {
  TempDir dir("mn_bench_report");
  const auto row = [](const std::string& name, const json& counters) { return iteration_row(name, counters); };
  // Peak 300 GFLOP/s on 2 threads (150 on 1); GEMM 1024^3 at 255 GFLOP/s (85 %), 2048^3 at 210 (70 %).
  const auto r = report_rows(
      dir.path(), {{"mn_bench_bandwidth", {row("BM_FmaPeak/threads:1/real_time", {{"peak_GFLOPs", 150.0}, {"lanes", 16}}),
                                           row("BM_FmaPeak/threads:2/real_time", {{"peak_GFLOPs", 300.0}, {"lanes", 16}})}},
                   {"mn_bench_matmul", {row("BM_MatmulSquare/n:1024/real_time", {{"GFLOPS", 255e9}}),
                                        row("BM_MatmulSquare/n:2048/real_time", {{"GFLOPS", 210e9}})}}});
  INFO(r.all());
  REQUIRE(r.status == 0);
  CHECK(std::regex_search(r.out, std::regex(R"(f32 FMA peak, 2 threads: 300\.0 GFLOP/s)")));
  CHECK(std::regex_search(r.out, std::regex(R"(1024\^3: 255\.0 GFLOP/s = 85% of the 2-thread peak)")));
  CHECK(std::regex_search(r.out, std::regex(R"(f32 GEMM 1024\^3 / FMA peak\s+85% \(255\.0 GFLOP/s\)\s+>= 80%\s+ok)")));
  CHECK(std::regex_search(r.out, std::regex(R"(f32 GEMM 2048\^3 / FMA peak\s+70% \(210\.0 GFLOP/s\)\s+>= 80%\s+OVER)")));
  const json s = read_json(dir.path() / "summary.json");
  CHECK(s["matmul"]["n_1024"]["fraction_of_peak"].get<double>() == doctest::Approx(0.85));
  CHECK(s["bandwidth"]["fma_peak_gflops_threads_2"].get<double>() == doctest::Approx(300.0));
}

TEST_CASE("bench report: the targets' GEMM shapes on one thread, packed against Eigen's kernel") {
  TempDir dir("mn_bench_report");
  // 1-thread peak 200 GFLOP/s; shape 0: packed 170 (85 %), Eigen's 100; shape 1: packed 150 (75 %), Eigen's 150.
  const auto shape = [](int index, int kernel, double gflops, const std::string& label) {
    json r = iteration_row("BM_GemmTargetShape/shape:" + std::to_string(index) + "/kernel:" + std::to_string(kernel) +
                               "/real_time",
                           {{"GFLOPS", gflops * 1e9}, {"packed", kernel == 0 ? 1 : 0}});
    r["label"] = label;
    return r;
  };
  const auto r = report_rows(
      dir.path(), {{"mn_bench_bandwidth", {iteration_row("BM_FmaPeak/threads:1/real_time", {{"peak_GFLOPs", 200.0}, {"lanes", 16}})}},
                   {"mn_bench_matmul", {shape(0, 0, 170, "first product"), shape(0, 1, 100, "first product"),
                                        shape(1, 0, 150, "second product"), shape(1, 1, 150, "second product")}}});
  INFO(r.all());
  REQUIRE(r.status == 0);
  CHECK(std::regex_search(r.out, std::regex(R"(first product\s+170\.0\s+85%\s+100\.0\s+0\.59)")));
  CHECK(std::regex_search(r.out, std::regex(R"(second product\s+150\.0\s+75%\s+150\.0\s+1\.00)")));
  CHECK(std::regex_search(r.out, std::regex(R"(f32 GEMM, targets' shapes, 1 thread / FMA peak\s+75-85%\s+>= 80%\s+OVER)")));
  const json s = read_json(dir.path() / "summary.json");
  REQUIRE(s["matmul"]["target_shapes"].size() == 2);
  CHECK(s["matmul"]["target_shapes"][0]["fraction_of_peak"].get<double>() == doctest::Approx(0.85));
  CHECK(s["matmul"]["target_shapes"][1]["eigen_gflops"].get<double>() == doctest::Approx(150.0));
}
