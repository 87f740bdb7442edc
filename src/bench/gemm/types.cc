#include "bench/gemm/types.h"

#include "common/error.h"

namespace keel::bench {

std::string_view gemm_type_name(GemmType t) {
  switch (t) {
    case GemmType::kBF16: return "bf16";
    case GemmType::kFP16: return "fp16";
    case GemmType::kFP8: return "fp8";
    case GemmType::kFP32: return "fp32";
    case GemmType::kTF32: return "tf32";
  }
  return "?";
}

GemmType parse_gemm_type(std::string_view name) {
  if (name == "bf16" || name == "bfloat16") return GemmType::kBF16;
  if (name == "fp16" || name == "half" || name == "float16") return GemmType::kFP16;
  if (name == "fp8" || name == "fp8_e4m3" || name == "e4m3") return GemmType::kFP8;
  if (name == "fp32" || name == "float" || name == "float32") return GemmType::kFP32;
  if (name == "tf32") return GemmType::kTF32;
  fail("unknown dtype '{}' (choose bf16, fp16, fp8, fp32 or tf32)", name);
}

std::size_t gemm_input_bytes(GemmType t) {
  switch (t) {
    case GemmType::kFP8: return 1;
    case GemmType::kBF16:
    case GemmType::kFP16: return 2;
    default: return 4;
  }
}

std::size_t gemm_output_bytes(GemmType t) { return t == GemmType::kFP32 || t == GemmType::kTF32 ? 4 : 2; }

double gemm_spec_tflops(GemmType t, const hw::HardwareProfile& p) {
  switch (t) {
    case GemmType::kBF16: return p.bf16_tflops;
    case GemmType::kFP16: return p.fp16_tflops;
    case GemmType::kFP8: return p.fp8_tflops;
    case GemmType::kFP32: return p.fp32_tflops;
    case GemmType::kTF32: return p.tf32_tflops;
  }
  return 0;
}

std::string_view layout_name(Layout l) {
  switch (l) {
    case Layout::kNN: return "nn";
    case Layout::kNT: return "nt";
    case Layout::kTN: return "tn";
    case Layout::kTT: return "tt";
  }
  return "?";
}

Layout parse_layout(std::string_view name) {
  if (name == "nn") return Layout::kNN;
  if (name == "nt") return Layout::kNT;
  if (name == "tn") return Layout::kTN;
  if (name == "tt") return Layout::kTT;
  fail("unknown --layout '{}' (choose nn, nt, tn or tt: A then B, n = as stored, t = transposed)", name);
}

}  // namespace keel::bench
