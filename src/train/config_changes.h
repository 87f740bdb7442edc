// What changed between the config a checkpoint recorded and the one a run is started with: the
// lines keel train prints when it resumes or starts from a checkpoint's weights.
#pragma once

#include <string>

#include "model/config.h"

namespace keel::train {

// How config text `now` differs from `saved` in the keys starting with `prefix` (dotted names,
// list items by index): "optimizer.lr 3.0e-3 -> 1.0e-3, checkpoint.interval (unset) -> 1".
// Numbers compare by value (3.0e-3 equals 0.003). "" when nothing differs or either text does
// not parse.
std::string config_changes(const std::string& saved, const std::string& now, const std::string& prefix);

// How `model` differs from the model the checkpoint `dir` records (its saved train config), in
// the keys that shape the computation: "rope_base 5000000 -> 10000, ..."; "" when it records
// none or the same.
std::string recorded_model_changes(const std::string& dir, const model::ModelConfig& model);

}  // namespace keel::train
