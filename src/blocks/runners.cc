#include "blocks/runners.h"

namespace keel::blocks {

LinearRunner& local_linear() {
  static LinearRunner r;
  return r;
}

AttentionCore& local_attention() { return ops::whole_sequences(); }

TokenGroup& local_tokens() {
  static TokenGroup g;
  return g;
}

}  // namespace keel::blocks
