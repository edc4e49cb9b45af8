// mn-paper: the Fashion-MNIST rows of the paper's Tables 1, 6, 7 and 8 as one command. Each row is
// one mn-train run per seed (mn-train --json; its last stdout line is the summary read here), and the
// result is one table: our trainable count (flagged when it differs from the paper's), our test
// accuracy over the seeds, the paper's figure and the best public reimplementation's.
//
//   mn-paper --tables 1 --rows cnn2 --epochs 10 --seeds 3 --out runs/paper
//   mn-paper --quick --tables 8 --dry-run          # the mn-train command lines only
//
// Rows and how the paper's ambiguities are resolved: examples/paper_rows.h. --rows REGEX keeps the
// rows whose id (e.g. "t1:cnn2-slvt-2048", "t6:cnn2-lwt-2688-stab") it matches anywhere. Rows of
// different tables with the same configuration (Table 1's CNN2 rows reappear in Tables 6, 7 and 8)
// share one run. --seeds N runs seeds 0..N-1; --seeds 3,7 runs seeds 3 and 7.
//
// Runs live in OUT/runs/<configuration>/seed-<s>/ (mn-train's --out: metrics.csv, checkpoint,
// stdout.log, stderr.log) with mn-paper-run.json (the run's flags and seed) and, once finished,
// result.json (mn-train's summary). Running mn-paper again with the same --out reuses every finished
// run with the same --epochs, continues one with fewer epochs (or an interrupted one) with mn-train
// --resume, and refuses a directory holding another configuration or more epochs. --device and
// --threads are passed to mn-train and are not part of a run's identity; --limit, --mapper,
// --mapped-args (default: batch 256 and a cosine schedule, the README's CNN2 settings) and --train-args
// are.
//
// A row whose flags this mn-train does not accept (it exits with CLI11's usage error, code >= 100, e.g.
// "The following arguments were not expected: --rank 32") shows "unavailable: <its first error line>"
// and the other rows still run; a row that cannot run with this library at all shows "not run: <why>".
// The accuracy column is mean ± sample standard deviation (n - 1) over the seeds that finished, with
// min-max beside it; the table goes to stdout and to OUT/paper.md and OUT/paper.json. The exit status
// is 1 when a run failed (not for unavailable or not-run rows), 2 for a bad command line.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <regex>
#include <set>

#include "cli_checks.h"
#include "paper_rows.h"
#include "paper_runs.h"

using namespace mn::examples::paper;

namespace {

struct Options {
  std::string tables = "1,6,7,8";
  std::string rows;
  std::string seeds = "1";
  int64_t epochs = 10;
  int64_t limit = -1;  // -1: not given (--quick: 2000; else all images)
  bool quick = false;
  std::string device, threads, mapper, train_args, mn_train, out = "out/mn-paper";
  // The mapped rows' training settings: those of the README's CNN2 runs (the paper discloses none; its
  // reference setup is Adam at 1e-2 with cosine decay and batch 128-256). mn-train's defaults (batch
  // 128, constant learning rate) cost the Mapping-Loss runs several points in 10 epochs.
  std::string mapped_args = "--batch-size 256 --scheduler cosine";
  int jobs = 1;
  bool dry_run = false;
};

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::istringstream in(text);
  std::string part;
  while (std::getline(in, part, sep))
    if (!part.empty()) parts.push_back(part);
  return parts;
}

std::vector<uint64_t> parse_seeds(const std::string& text) {
  std::vector<uint64_t> seeds;
  const std::vector<std::string> parts = split(text, ',');
  if (parts.empty()) throw CLI::ValidationError("--seeds", "expected N or a comma list of seeds, got '" + text + "'");
  try {
    if (text.find(',') == std::string::npos) {
      const uint64_t n = std::stoull(parts[0]);
      if (n == 0) throw CLI::ValidationError("--seeds", "expected at least 1 seed, got 0");
      for (uint64_t s = 0; s < n; ++s) seeds.push_back(s);
    } else {
      for (const std::string& p : parts)
        if (std::find(seeds.begin(), seeds.end(), std::stoull(p)) == seeds.end()) seeds.push_back(std::stoull(p));
    }
  } catch (const std::logic_error&) {
    throw CLI::ValidationError("--seeds", "expected N or a comma list of seeds, got '" + text + "'");
  }
  return seeds;
}

// The executable next to this one, unless --mn-train names another.
std::string find_mn_train(const std::string& given) {
  if (!given.empty()) return given;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "mn-train" : (self.parent_path() / "mn-train").string();
}

// A row's flags with the run-wide ones (--mapper and --mapped-args for mapped rows, --limit, --train-args).
std::vector<std::string> full_args(const Row& row, const Options& o, int64_t limit) {
  std::vector<std::string> a = row.args;
  if (row.mapped) {
    if (!o.mapper.empty()) a.insert(a.end(), {"--mapper", o.mapper});
    for (const std::string& w : split(o.mapped_args, ' ')) a.push_back(w);
  }
  if (limit > 0) a.insert(a.end(), {"--limit", std::to_string(limit)});
  for (const std::string& w : split(o.train_args, ' ')) a.push_back(w);
  return a;
}

std::string fixed(double v, int digits = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string thousands(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return (n < 0 ? "-" : "") + out;
}

// One row of the report from its runs.
json report_row(const Row& row, const std::vector<const Run*>& runs) {
  json j = {{"table", row.table}, {"id", row.id},           {"row", row.label},
            {"paper", row.paper}, {"paper_params", row.paper_params},
            {"reimplementation", row.reimpl ? json(*row.reimpl) : json(nullptr)},
            {"note", row.note}};
  std::vector<double> acc;
  std::vector<uint64_t> seeds;
  int64_t params = row.planned_params, epochs = 0;
  double seconds = 0;
  std::string status = row.not_run;
  for (const Run* r : runs) {
    if (r->outcome == Outcome::Done) {
      if (!r->result.contains("test_accuracy") || r->result["test_accuracy"].is_null()) continue;
      acc.push_back(100.0 * r->result["test_accuracy"].get<double>());
      seeds.push_back(r->seed);
      params = r->result.value("trainable_params", params);
      epochs = r->result.value("epochs", epochs);
      seconds += r->result.value("seconds", 0.0);
    } else if (status.empty() && r->outcome != Outcome::Pending) {
      status = r->message;
    }
  }
  if (runs.empty() && status.empty()) status = "not run";
  j["args"] = row.args;
  j["status"] = status.empty() ? "ok" : status;
  j["trainable_params"] = row.not_run.empty() ? json(params) : json(nullptr);
  j["params_match"] = row.not_run.empty() ? json(params == row.paper_params) : json(nullptr);
  j["seeds"] = seeds;
  j["accuracies"] = acc;
  j["epochs"] = epochs;
  j["seconds"] = seconds;
  if (!acc.empty()) {
    double mean = 0, var = 0;
    for (double a : acc) mean += a / static_cast<double>(acc.size());
    for (double a : acc) var += (a - mean) * (a - mean);
    j["mean"] = mean;
    j["std"] = acc.size() > 1 ? std::sqrt(var / static_cast<double>(acc.size() - 1)) : 0.0;
    j["min"] = *std::min_element(acc.begin(), acc.end());
    j["max"] = *std::max_element(acc.begin(), acc.end());
  }
  return j;
}

std::string markdown(const json& report, const std::string& header) {
  std::string md = header +
                   "\n| table | row | id | trainable (ours) | paper # params | ours: test acc % (mean ± std) | "
                   "min–max | seeds | epochs | paper | public reimpl. | status / note |\n"
                   "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
  for (const json& r : report["rows"]) {
    std::string params = r["trainable_params"].is_null() ? "–" : thousands(r["trainable_params"].get<int64_t>());
    if (r["params_match"] == false) params += " ≠";
    std::string acc = "–", range = "–";
    if (r.contains("mean")) {
      acc = fixed(r["mean"].get<double>()) + (r["accuracies"].size() > 1 ? " ± " + fixed(r["std"].get<double>()) : "");
      range = fixed(r["min"].get<double>()) + "–" + fixed(r["max"].get<double>());
    }
    std::string status = r["status"] == "ok" ? "" : r["status"].get<std::string>();
    const std::string note = r["note"].get<std::string>();
    if (!note.empty()) status += (status.empty() ? "" : "; ") + note;
    for (char& c : status)
      if (c == '|') c = '/';
    md += "| " + r["table"].get<std::string>() + " | " + r["row"].get<std::string>() + " | `" +
          r["id"].get<std::string>() + "` | " + params + " | " + thousands(r["paper_params"].get<int64_t>()) + " | " +
          acc + " | " + range + " | " + std::to_string(r["accuracies"].size()) + " | " +
          std::to_string(r["epochs"].get<int64_t>()) + " | " + fixed(r["paper"].get<double>()) + " | " +
          (r["reimplementation"].is_null() ? "–" : fixed(r["reimplementation"].get<double>())) + " | " + status +
          " |\n";
  }
  return md +
         "\nTrainable (ours): mn-train's count, or what the flags should give when no run finished; ≠: it differs "
         "from the paper's. Accuracy: mean ± sample std (n − 1) over the seeds that finished. Public "
         "reimplementation: penglei0501/Mapping-Networks.\n";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Run the Fashion-MNIST rows of the Mapping Networks paper's Tables 1, 6, 7 and 8 with mn-train"};
  Options o;
  mn::examples::add_version_flag(app, "mn-paper");
  app.add_option("--tables", o.tables, "comma list of the tables to run (1, 6, 7, 8)")->capture_default_str();
  app.add_option("--rows", o.rows, "keep only the rows whose id matches this regular expression");
  app.add_option("--seeds", o.seeds, "N (seeds 0..N-1) or a comma list of seeds")->capture_default_str();
  app.add_option("--epochs", o.epochs, "epochs of every run (--quick: 1)")
      ->check(mn::examples::whole_number_at_least(1))
      ->capture_default_str();
  app.add_option("--limit", o.limit, "mn-train --limit: the first N training and test images (--quick: 2000)")
      ->check(mn::examples::whole_number_at_least(0));
  app.add_flag("--quick", o.quick, "a smoke-test budget: --limit 2000 and 1 epoch unless given");
  app.add_option("--device", o.device, "mn-train --device (cpu, cuda[:N], auto)");
  app.add_option("--threads", o.threads, "mn-train --threads of each run")
      ->check(mn::examples::whole_number_at_least(1));
  app.add_option("--mapper", o.mapper, "mn-train --mapper of the mapped rows (default: mn-train's)");
  app.add_option("--mapped-args", o.mapped_args,
                 "mn-train flags of the mapped rows, space-separated ('': mn-train's defaults: batch 128, no schedule)")
      ->capture_default_str();
  app.add_option("--train-args", o.train_args, "more mn-train flags for every row, space-separated");
  app.add_option("--jobs", o.jobs, "runs at the same time")->check(mn::examples::whole_number_at_least(1));
  app.add_option("--mn-train", o.mn_train, "the mn-train executable (default: the one beside mn-paper)");
  app.add_option("--out", o.out, "directory of the runs and of paper.md / paper.json")->capture_default_str();
  app.add_flag("--dry-run", o.dry_run, "print the mn-train command lines and stop");
  CLI11_PARSE(app, argc, argv);

  std::vector<uint64_t> seeds;
  std::optional<std::regex> filter;
  try {
    seeds = parse_seeds(o.seeds);
    if (!o.rows.empty()) filter.emplace(o.rows, std::regex::ECMAScript);
  } catch (const CLI::Error& e) {
    return app.exit(e);
  } catch (const std::regex_error& e) {
    std::fprintf(stderr, "mn-paper: --rows '%s' is not a regular expression: %s\n", o.rows.c_str(), e.what());
    return 2;
  }
  if (o.quick && app.count("--epochs") == 0) o.epochs = 1;
  const int64_t limit = o.limit >= 0 ? o.limit : (o.quick ? 2000 : 0);
  const std::set<std::string> known{"1", "6", "7", "8"};
  const std::vector<std::string> tables = split(o.tables, ',');
  for (const std::string& t : tables)
    if (known.count(t) == 0) {
      std::fprintf(stderr, "mn-paper: --tables: expected a comma list of 1, 6, 7, 8, got '%s'\n", t.c_str());
      return 2;
    }
  std::vector<Row> rows;
  for (const Row& r : all_rows())
    if (std::count(tables.begin(), tables.end(), r.table) > 0 && (!filter || std::regex_search(r.id, *filter)))
      rows.push_back(r);
  if (rows.empty()) {
    std::fprintf(stderr, "mn-paper: no row of tables %s matches --rows '%s'\n", o.tables.c_str(), o.rows.c_str());
    return 2;
  }

  // One run per distinct configuration and seed.
  const RunSettings settings{find_mn_train(o.mn_train), o.epochs, o.device, o.threads};
  const fs::path out(o.out);
  std::vector<Run> runs;
  std::map<std::vector<std::string>, size_t> first_run;
  for (const Row& r : rows) {
    if (!r.not_run.empty()) continue;
    const std::vector<std::string> args = full_args(r, o, limit);
    if (first_run.count(args) > 0) continue;
    first_run[args] = runs.size();
    for (uint64_t s : seeds) {
      Run run{args, s, out / "runs" / run_name(args) / ("seed-" + std::to_string(s))};
      plan(run, o.epochs);
      runs.push_back(run);
    }
  }
  if (o.dry_run) {
    for (const Run& r : runs) {
      if (r.reused) std::printf("# finished, reused: %s\n", r.dir.c_str());
      else if (r.outcome == Outcome::Failed) std::printf("# %s\n", r.message.c_str());
      else std::printf("%s\n", command_line(r.argv(settings)).c_str());
    }
    for (const Row& r : rows)
      if (!r.not_run.empty()) std::printf("# %s: %s\n", r.id.c_str(), r.not_run.c_str());
    return 0;
  }

  std::error_code ec;
  fs::create_directories(out, ec);
  const auto start = std::chrono::steady_clock::now();
  size_t ended = 0;
  for (const Run& r : runs) ended += r.outcome != Outcome::Pending;
  run_all(runs, settings, o.jobs, [&](const Run& r) {
    ++ended;
    std::string what = r.message;
    if (r.outcome == Outcome::Done)
      what = "test " + fixed(100.0 * r.result.value("test_accuracy", 0.0)) + " % after " +
             mn::examples::count_of(r.result.value("epochs", int64_t{0}), "epoch") + ", " +
             fixed(r.result.value("seconds", 0.0), 0) + " s";
    std::fprintf(stderr, "mn-paper: [%zu/%zu] %s seed %llu: %s\n", ended, runs.size(), run_name(r.args).c_str(),
                 static_cast<unsigned long long>(r.seed), what.c_str());
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  json report = {{"command", command_line(std::vector<std::string>(argv, argv + argc))},
                 {"mn_train", settings.mn_train},
                 {"epochs", o.epochs},
                 {"limit", limit},
                 {"seeds", seeds},
                 {"wall_seconds", wall},
                 {"rows", json::array()}};
  bool failed = false;
  for (const Row& r : rows) {
    std::vector<const Run*> mine;
    if (r.not_run.empty())
      for (const Run& run : runs)
        if (run.args == full_args(r, o, limit)) mine.push_back(&run);
    for (const Run* run : mine) failed |= run->outcome == Outcome::Failed;
    report["rows"].push_back(report_row(r, mine));
  }
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  const std::string header = "mn-paper, " + std::string(when) + ": `" + report["command"].get<std::string>() + "`; " +
                             mn::examples::count_of(o.epochs, "epoch") + ", " +
                             (limit > 0 ? std::to_string(limit) + " images" : std::string("all images")) + ", " +
                             std::to_string(seeds.size()) + " seed(s), " + fixed(wall, 0) + " s.\n";
  const std::string md = markdown(report, header);
  std::printf("%s", md.c_str());
  std::ofstream(out / "paper.md") << md;
  write_json(out / "paper.json", report);
  return failed ? 1 : 0;
}
