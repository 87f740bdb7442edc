// Element types and operand layouts of `keel bench gemm`.
#pragma once

#include <cstddef>
#include <string_view>

#include "hw/hardware.h"

namespace keel::bench {

// Inputs and output per type: bf16 -> bf16, fp16 -> fp16, fp8 (e4m3 inputs with per-tensor
// scales) -> bf16, fp32 -> fp32, tf32 (fp32 storage, tensor cores in tf32) -> fp32. Every
// type accumulates in fp32.
enum class GemmType { kBF16, kFP16, kFP8, kFP32, kTF32 };

std::string_view gemm_type_name(GemmType t);
// bf16/bfloat16, fp16/half, fp8/fp8_e4m3/e4m3, fp32/float, tf32; throws keel::Error otherwise.
GemmType parse_gemm_type(std::string_view name);
std::size_t gemm_input_bytes(GemmType t);   // per element of A and B
std::size_t gemm_output_bytes(GemmType t);  // per element of C
// Dense tensor-core (or FMA for fp32) spec peak in TFLOP/s; 0 when the profile has none.
double gemm_spec_tflops(GemmType t, const hw::HardwareProfile& p);

// Row-major operands: C[m x n] = op(A) op(B). First letter: A stored [m x k] (n) or [k x m]
// (t); second: B stored [k x n] (n) or [n x k] (t). "nt" is a linear layer's forward
// (X W^T with W stored [out x in]); torch.matmul of two contiguous matrices is "nn".
enum class Layout { kNN, kNT, kTN, kTT };

std::string_view layout_name(Layout l);
Layout parse_layout(std::string_view name);
inline bool a_transposed(Layout l) { return l == Layout::kTN || l == Layout::kTT; }
inline bool b_transposed(Layout l) { return l == Layout::kNT || l == Layout::kTT; }

}  // namespace keel::bench
