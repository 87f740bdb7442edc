#include "blocks/cuda/runners.h"

namespace keel::blocks::cuda {

LinearRunner& local_linear() {
  static LinearRunner r;
  return r;
}

AttentionCore& local_attention() { return ops::cuda::whole_sequences(); }

}  // namespace keel::blocks::cuda
