// Prints how many GPUs keel sees: device/cuda_devices.h's count, the one keel's own `device:
// auto` and `--backend auto` choices read (0 in a CPU-only build or without a driver;
// CUDA_VISIBLE_DEVICES respected). tests/expect.sh --gpus asks it, so a command-line test whose
// outcome depends on the number of GPUs runs where that number is right and is skipped elsewhere.
#include <cstdio>

#include "device/cuda_devices.h"

int main() {
  std::printf("%d\n", keel::visible_cuda_devices());
  return 0;
}
