// How many CUDA devices this process can use: the one place backends ask before choosing a
// GPU path, so a HIP port changes it here.
#pragma once

namespace keel {

// Number of visible CUDA devices; 0 without a driver or device, and in a CPU-only build.
int visible_cuda_devices();
// Makes `device` (0-based, < visible_cuda_devices()) current for this thread; throws
// keel::Error when it cannot (or in a CPU-only build).
void set_cuda_device(int device);

}  // namespace keel
