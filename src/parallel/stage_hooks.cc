#include "parallel/stage_hooks.h"

namespace keel::parallel {

StageHooks& no_stage_hooks() {
  static StageHooks none;
  return none;
}

}  // namespace keel::parallel
