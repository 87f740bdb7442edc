// Rotary position embedding on the GPU: the CUDA twin of ops/rope.h (rotate-half pairing,
// channel i with i + R/2, partial rotation of the first R = rotary_dim channels of each head).
//
// In place on bf16 activations x [n, heads, head_dim] (q or k after their projection); the
// math is fp32 with the SAME fp32 cos/sin table as ops::rope::Table (upload it once with
// UploadedTable), and the products are kept unfused so each rotated value is the CPU op's fp32
// value rounded once to bf16. positions [n] int32 (device). Channels past rotary_dim are not
// touched. Nothing is saved for backward but the positions; backward is the inverse rotation
// applied in place to the incoming gradient (dy -> dx, overwritten).
//
// Positions are not validated here (that would need a sync): the caller builds them on the host
// and checks them there (ops::rope's CPU check, or its own). A position outside
// [0, max_positions) is never used as an address: that token is left unrotated.
#pragma once

#include <cstdint>

#include "ops/cuda/common.h"
#include "ops/rope.h"

namespace keel::ops::cuda::rope {

// Device view of an ops::rope::Table: cos, sin [max_positions, rotary_dim / 2] fp32.
struct DeviceTable {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int head_dim = 0;
  int rotary_dim = 0;
  int max_positions = 0;
};

// Owns a device copy of a table (uploaded synchronously at construction, on the current device).
class UploadedTable {
 public:
  explicit UploadedTable(const ops::rope::Table& t);
  ~UploadedTable();
  UploadedTable(const UploadedTable&) = delete;
  UploadedTable& operator=(const UploadedTable&) = delete;
  const DeviceTable& view() const { return view_; }

 private:
  float* cos_ = nullptr;
  float* sin_ = nullptr;
  DeviceTable view_;
};

// x [n, heads, head_dim] bf16 rotated in place by each token's position.
void forward(const DeviceTable& t, bf16* x, const std::int32_t* positions, std::int64_t n, std::int64_t heads,
             cudaStream_t stream);
// dx = R^T dy in place on g [n, heads, head_dim] bf16 (g holds dy on entry, dx on return).
void backward(const DeviceTable& t, bf16* g, const std::int32_t* positions, std::int64_t n, std::int64_t heads,
              cudaStream_t stream);

}  // namespace keel::ops::cuda::rope
