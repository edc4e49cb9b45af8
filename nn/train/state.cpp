#include <cmath>
#include <limits>
#include <type_traits>

#include "nn/grad_scaler.h"
#include "nn/train/state_json.h"

namespace mn::train {

namespace detail {

using json = nlohmann::json;

namespace {

// NaN / inf have no JSON spelling: null stands for "not finite" and reads back as NaN.
json finite_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }
double number_or_nan(const json& v) { return v.is_null() ? std::numeric_limits<double>::quiet_NaN() : v.get<double>(); }

json scalar_state_json(const std::map<std::string, double>& state) {
  json out = json::object();
  for (const auto& [key, value] : state) out[key] = finite_or_null(value);
  return out;
}

std::map<std::string, double> parse_scalar_state(const json& j) {
  std::map<std::string, double> out;
  for (const auto& [key, value] : j.items()) out[key] = number_or_nan(value);
  return out;
}

// The progress sums must come back exactly, non-finite values included (an epoch mean of inf is not one
// of NaN): numbers as they are, the others as strings.
json exact_number(double v) {
  if (std::isfinite(v)) return v;
  return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
}
double parse_exact_number(const json& v) {
  if (v.is_number()) return v.get<double>();
  const std::string text = v.get<std::string>();
  if (text == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (text == "inf") return std::numeric_limits<double>::infinity();
  if (text == "-inf") return -std::numeric_limits<double>::infinity();
  throw ValueError(str("expected a number, \"nan\", \"inf\" or \"-inf\", got ", v.dump()));
}

json progress_json(const EpochProgress& p) {
  json sums = json::array();
  for (const PassSums& s : p.sums)
    sums.push_back({{"task", exact_number(s.task)},
                    {"total", exact_number(s.total)},
                    {"accuracy", exact_number(s.accuracy)},
                    {"samples", s.samples},
                    {"accuracy_samples", s.accuracy_samples}});
  json out = {{"batches", p.batches}, {"nonfinite_steps", p.nonfinite_steps}, {"sums", sums}};
  if (p.skipped_steps != 0) out["skipped_steps"] = p.skipped_steps;
  return out;
}

}  // namespace

template <class T>
T whole_number(const json& v) {
  const bool fits = std::is_signed_v<T>
                        ? v.is_number_integer() && (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(INT64_MAX))
                        : v.is_number_unsigned();
  if (!fits)
    throw ValueError(str("expected a whole number", std::is_signed_v<T> ? "" : " >= 0", " in range, got ", v.dump()));
  return v.get<T>();
}
template int64_t whole_number<int64_t>(const json&);
template uint64_t whole_number<uint64_t>(const json&);

json history_json(const History& history) {
  json out = json::object();
  for (const auto& [key, values] : history.values()) {
    json list = json::array();
    for (double v : values) list.push_back(finite_or_null(v));
    out[key] = std::move(list);
  }
  return out;
}

json trainer_state_json(const TrainerState& s) {
  json j;
  j["epoch"] = s.epoch;
  j["should_stop"] = s.should_stop;
  j["scheduler_epoch"] = s.scheduler_epoch;
  // The optimizer's own state holds the lr as an f32 tensor; this keeps the exact double so a resumed
  // run continues with bit-identical updates.
  if (s.learning_rate) j["optimizer_lr"] = *s.learning_rate;
  if (!s.scheduler_state.empty()) j["scheduler_state"] = scalar_state_json(s.scheduler_state);
  if (s.scheduler_step_metric) j["scheduler_step_metric"] = finite_or_null(*s.scheduler_step_metric);
  if (!s.callback_states.empty()) {
    json callbacks = json::object();
    for (const auto& [key, state] : s.callback_states) callbacks[key] = scalar_state_json(state);
    j["callbacks"] = std::move(callbacks);
  }
  j["history"] = history_json(s.history);
  j["rng"] = {{"trainer_seed", s.rng.trainer_seed},
              {"trainer_offset", s.rng.trainer_offset},
              {"global_seed", s.rng.global_seed},
              {"global_offset", s.rng.global_offset}};
  if (s.global_step) j["global_step"] = *s.global_step;
  if (s.progress) j["progress"] = progress_json(*s.progress);
  if (!s.grad_scaler.empty()) j["grad_scaler"] = s.grad_scaler;  // finite by GradScaler's invariants
  return j;
}

TrainerState parse_trainer_state(const json& j) {
  TrainerState s;
  s.epoch = whole_number<int64_t>(j.at("epoch"));
  s.should_stop = j.at("should_stop").get<bool>();
  s.scheduler_epoch = j.contains("scheduler_epoch") ? whole_number<int64_t>(j.at("scheduler_epoch")) : 0;
  if (j.contains("optimizer_lr")) s.learning_rate = j.at("optimizer_lr").get<double>();
  if (j.contains("scheduler_state")) s.scheduler_state = parse_scalar_state(j.at("scheduler_state"));
  if (j.contains("scheduler_step_metric")) s.scheduler_step_metric = number_or_nan(j.at("scheduler_step_metric"));
  if (j.contains("callbacks"))
    for (const auto& [key, state] : j.at("callbacks").items()) s.callback_states[key] = parse_scalar_state(state);
  if (j.contains("history"))
    for (const auto& [key, values] : j.at("history").items())
      for (const json& v : values) s.history.append(key, number_or_nan(v));
  if (j.contains("rng")) {
    const json& r = j.at("rng");
    s.rng.trainer_seed = whole_number<uint64_t>(r.at("trainer_seed"));
    s.rng.trainer_offset = whole_number<uint64_t>(r.at("trainer_offset"));
    s.rng.global_seed = whole_number<uint64_t>(r.at("global_seed"));
    s.rng.global_offset = whole_number<uint64_t>(r.at("global_offset"));
  }
  if (j.contains("global_step")) s.global_step = whole_number<int64_t>(j.at("global_step"));
  if (j.contains("progress")) {
    const json& p = j.at("progress");
    EpochProgress progress;
    progress.batches = whole_number<int64_t>(p.at("batches"));
    progress.nonfinite_steps = whole_number<int64_t>(p.at("nonfinite_steps"));
    for (const json& sum : p.at("sums")) {
      PassSums rank;
      rank.task = parse_exact_number(sum.at("task"));
      rank.total = parse_exact_number(sum.at("total"));
      rank.accuracy = parse_exact_number(sum.at("accuracy"));
      rank.samples = whole_number<int64_t>(sum.at("samples"));
      rank.accuracy_samples = whole_number<int64_t>(sum.at("accuracy_samples"));
      if (rank.samples < 0 || rank.accuracy_samples < 0 || rank.accuracy_samples > rank.samples)
        throw ValueError(str("progress: sample counts must satisfy 0 <= accuracy_samples <= samples, got ",
                             sum.dump()));
      progress.sums.push_back(rank);
    }
    if (p.contains("skipped_steps")) progress.skipped_steps = whole_number<int64_t>(p.at("skipped_steps"));
    if (progress.batches < 1 || progress.nonfinite_steps < 0 || progress.skipped_steps < 0 || progress.sums.empty())
      throw ValueError(str("progress: expected batches >= 1, nonfinite_steps >= 0, skipped_steps >= 0 and the sums "
                           "of at least one rank, got ", p.dump()));
    s.progress = std::move(progress);
  }
  if (j.contains("grad_scaler")) {
    for (const auto& [key, value] : j.at("grad_scaler").items()) s.grad_scaler[key] = value.get<double>();
    amp::GradScaler::check_state_dict(s.grad_scaler, "grad_scaler");
  }
  return s;
}

}  // namespace detail

std::string trainer_state_to_json(const TrainerState& state) { return detail::trainer_state_json(state).dump(); }

TrainerState trainer_state_from_json(const std::string& text) {
  try {
    return detail::parse_trainer_state(nlohmann::json::parse(text));
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(str("trainer state: not a valid document: ", e.what()));
  }
}

}  // namespace mn::train
