#pragma once
// mn-paper's runs: one mn-train process per (configuration, seed), each in its own directory under
// --out, started with posix_spawn (stdout and stderr to files there) and reaped as they end, at most
// --jobs at a time. A directory remembers its run (mn-paper-run.json: mn-train's flags and the seed)
// and, once finished, mn-train's JSON summary (result.json), so a second mn-paper reuses it; a run with
// a checkpoint but fewer epochs than asked is continued with mn-train --resume.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace mn::examples::paper {

namespace fs = std::filesystem;
using json = nlohmann::json;

// `text` as one shell word (quoted only when it needs to be).
inline std::string shell_word(const std::string& text) {
  if (!text.empty() && text.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,+") ==
                           std::string::npos)
    return text;
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

inline std::string command_line(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& a : argv) line += (line.empty() ? "" : " ") + shell_word(a);
  return line;
}

// A directory name for a configuration: its flags without dashes, joined ("target-cnn2_strategy-slvt...").
inline std::string run_name(const std::vector<std::string>& args) {
  std::string name;
  for (const std::string& a : args) {
    const bool flag = a.rfind("--", 0) == 0;
    std::string part = flag ? a.substr(2) : a;
    for (char& c : part)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-') c = '-';
    name += name.empty() ? part : (flag ? "_" : "-") + part;
  }
  return name;
}

struct RunSettings {
  std::string mn_train;                 // the executable
  int64_t epochs = 0;
  std::string device, threads;          // passed through when non-empty; not part of a run's identity
};

enum class Outcome { Pending, Done, Unavailable, Failed };

// One mn-train run: a configuration (flags) under one seed.
struct Run {
  std::vector<std::string> args;
  uint64_t seed = 0;
  fs::path dir;
  Outcome outcome = Outcome::Pending;
  bool reused = false, resume = false;
  std::string message;  // why it is unavailable or failed
  json result;          // mn-train's summary (Done)

  json identity() const { return {{"args", args}, {"seed", seed}}; }
  std::vector<std::string> argv(const RunSettings& s) const {
    std::vector<std::string> v{s.mn_train};
    v.insert(v.end(), args.begin(), args.end());
    for (const std::string& a : {std::string("--seed"), std::to_string(seed), std::string("--epochs"),
                                 std::to_string(s.epochs), std::string("--out"), dir.string(), std::string("--json")})
      v.push_back(a);
    if (!s.device.empty()) v.insert(v.end(), {"--device", s.device});
    if (!s.threads.empty()) v.insert(v.end(), {"--threads", s.threads});
    if (resume) v.push_back("--resume");
    return v;
  }
};

inline std::optional<json> read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  try {
    return json::parse(in);
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

inline void write_json(const fs::path& path, const json& j) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
  }
  fs::rename(tmp, path);
}

// What the directory already holds decides the run: reused (finished with these epochs), continued
// (--resume: a checkpoint with fewer), or refused (another configuration, or more epochs than asked).
inline void plan(Run& r, int64_t epochs) {
  if (const auto saved = read_json(r.dir / "mn-paper-run.json"); saved && *saved != r.identity()) {
    r.outcome = Outcome::Failed;
    r.message = "failed: " + r.dir.string() + " holds another run (" + saved->dump() + "); use another --out";
    return;
  }
  if (const auto result = read_json(r.dir / "result.json")) {
    const int64_t done = result->value("epochs", int64_t{0});
    if (done == epochs) {
      r.outcome = Outcome::Done;
      r.reused = true;
      r.result = *result;
      return;
    }
    if (done > epochs) {
      r.outcome = Outcome::Failed;
      r.message = "failed: " + r.dir.string() + " holds " + std::to_string(done) + " epochs, more than --epochs " +
                  std::to_string(epochs) + "; use another --out";
      return;
    }
  }
  r.resume = fs::exists(r.dir / "checkpoint.safetensors");
}

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The first line of stderr that is not a warning (else the last line of stdout).
inline std::string first_error_line(const fs::path& dir) {
  std::istringstream err(read_text(dir / "stderr.log"));
  std::string line, last;
  while (std::getline(err, line))
    if (!line.empty() && line.find("warning:") == std::string::npos) return line;
  std::istringstream out(read_text(dir / "stdout.log"));
  while (std::getline(out, line))
    if (!line.empty()) last = line;
  return last.empty() ? "(no output)" : last;
}

// Starts mn-train for `r`; returns its pid (0 when it could not start: the run is then Failed).
inline pid_t start(Run& r, const RunSettings& s) {
  std::error_code ec;
  fs::create_directories(r.dir, ec);
  write_json(r.dir / "mn-paper-run.json", r.identity());
  const std::vector<std::string> argv = r.argv(s);
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  const std::string out = (r.dir / "stdout.log").string(), err = (r.dir / "stderr.log").string();
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    r.outcome = Outcome::Failed;
    r.message = "failed: cannot start " + argv[0] + ": " + std::strerror(rc);
    return 0;
  }
  return pid;
}

// Reads what an ended mn-train left: its summary (exit 0), a command line it rejects (CLI11's exit
// codes are 100 and above: a flag or value this mn-train does not know), or a failure.
inline void finish(Run& r, int status) {
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 0) {
    std::istringstream out(read_text(r.dir / "stdout.log"));
    std::string line, last;
    while (std::getline(out, line))
      if (!line.empty()) last = line;
    try {
      r.result = json::parse(last);
      write_json(r.dir / "result.json", r.result);
      r.outcome = Outcome::Done;
      return;
    } catch (const json::exception&) {
      r.outcome = Outcome::Failed;
      r.message = "failed: mn-train's last line is not a JSON summary: " + last;
      return;
    }
  }
  r.outcome = code >= 100 ? Outcome::Unavailable : Outcome::Failed;
  const std::string why = code < 0 ? "killed by signal " + std::to_string(WTERMSIG(status)) : first_error_line(r.dir);
  r.message = (code >= 100 ? "unavailable: " : "failed: ") + why;
}

// Runs every pending run, `jobs` at a time, in order. A configuration one of whose runs this mn-train
// rejects is not tried with its other seeds. `progress` is told about each run that ends.
template <class Progress>
void run_all(std::vector<Run>& runs, const RunSettings& s, int jobs, Progress progress) {
  std::map<pid_t, size_t> running;
  std::map<std::vector<std::string>, std::string> rejected;
  size_t next = 0;
  while (true) {
    while (running.size() < static_cast<size_t>(jobs) && next < runs.size()) {
      Run& r = runs[next++];
      if (r.outcome != Outcome::Pending) continue;
      if (const auto it = rejected.find(r.args); it != rejected.end()) {
        r.outcome = Outcome::Unavailable;
        r.message = it->second;
        progress(r);
        continue;
      }
      if (const pid_t pid = start(r, s); pid > 0) running[pid] = &r - runs.data();
      else progress(r);
    }
    if (running.empty()) break;
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    const auto it = running.find(pid);
    if (it == running.end()) continue;
    Run& r = runs[it->second];
    running.erase(it);
    finish(r, status);
    if (r.outcome == Outcome::Unavailable) rejected[r.args] = r.message;
    progress(r);
  }
}

}  // namespace mn::examples::paper
