#pragma once
// Internal (not installed): the JSON form of TrainerState for the checkpoint writers in nn/train and
// mapping/, which embed it in a larger metadata document.
#include <nlohmann/json.hpp>

#include "nn/train/state.h"

namespace mn::train::detail {

nlohmann::json trainer_state_json(const TrainerState& state);
TrainerState parse_trainer_state(const nlohmann::json& j);  // nlohmann exceptions and ValueError escape
nlohmann::json history_json(const History& history);
// A whole number from metadata: nlohmann's get<int64_t>() also converts a float, and one outside the
// range (a damaged "2e32") is undefined behaviour; this refuses anything but an integer in range.
template <class T>
T whole_number(const nlohmann::json& v);

}  // namespace mn::train::detail
