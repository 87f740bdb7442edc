# `keel bench gemm` as a user runs it, on the CPU backend (OpenBLAS; see tests/CMakeLists.txt).
set(gemmq --backend cpu --threads 2 -w 1 --iters 3 --check-samples 16 --rotate 4M)

keel_cli_test(NAME gemm_cpu_sweep MATCH "Check: 48 sampled outputs .* 0 wrong. 0 GEMMs left NaN/inf in their output: OK"
  ARGS bench gemm ${gemmq} --m 64:192:64 --n 96 --k 80)
keel_cli_test(NAME gemm_cpu_default_square_sweep MATCH "1024 +1024 +1024 .* 16/16 ok"
  ARGS bench gemm ${gemmq})
keel_cli_test(NAME gemm_cpu_shapes_batched_layout MATCH "100 +50 +70 +3  tt  fp32"
  ARGS bench gemm ${gemmq} --shapes 100x50x70x3,17x19x23 --layout tt)
keel_cli_test(NAME gemm_cpu_model_yaml MATCH "expert_up_gate +bwd_weight"
  ARGS bench gemm ${gemmq} --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --step-tokens 128)
keel_cli_test(NAME gemm_cpu_model_flags MATCH "whole model \\(GEMMs x layers\\)"
  NOT "lm_head"
  ARGS bench gemm ${gemmq} --hidden 128 --heads 4 --kv-heads 2 --ffn 256 --experts 4 --top-k 2 --expert-width 64
       --router-width 32 --step-tokens 64 --forward-only)
add_test(NAME cli_gemm_outputs_files COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/bench/gemm/check_outputs.sh $<TARGET_FILE:keel>)
set_tests_properties(cli_gemm_outputs_files PROPERTIES TIMEOUT 300)

# The checker is live: a damaged output fails the run with exit 2.
keel_cli_test(NAME gemm_corruption_detected EXIT 2 MATCH "1 of 16 sampled outputs wrong, first at \\(batch 0, row 0, col 0\\)"
  ARGS bench gemm ${gemmq} --shapes 64x64x64 --inject-corrupt)

# Bad input: one clear line, non-zero exit.
keel_cli_test(NAME gemm_zero_dim EXIT nonzero MATCH "keel: error: --k must be positive, got 0"
  ARGS bench gemm --backend cpu --m 64 --n 64 --k 0)
keel_cli_test(NAME gemm_negative_dim EXIT nonzero MATCH "--shapes must be positive, got -8"
  ARGS bench gemm --backend cpu --shapes 64x-8x64)
keel_cli_test(NAME gemm_unknown_dtype EXIT nonzero MATCH "unknown dtype 'fp4'" ARGS bench gemm --backend cpu --dtype fp4)
keel_cli_test(NAME gemm_dtype_the_device_lacks EXIT nonzero MATCH "dtype bf16: --backend cpu runs fp32 only"
  ARGS bench gemm --backend cpu --dtype bf16 --shapes 64x64x64)
keel_cli_test(NAME gemm_out_of_memory EXIT nonzero MATCH "out of memory: 1048576x1048576x1048576 fp32 needs"
  ARGS bench gemm --backend cpu --mnk 1048576)
keel_cli_test(NAME gemm_partial_ranges EXIT nonzero MATCH "--m, --n and --k go together" ARGS bench gemm --backend cpu --m 64)
keel_cli_test(NAME gemm_two_ways EXIT nonzero MATCH "choose one way to give shapes"
  ARGS bench gemm --backend cpu --mnk 64 --shapes 64x64x64)
keel_cli_test(NAME gemm_model_needs_tokens EXIT nonzero MATCH "need --step-tokens \\(tokens per step\\)"
  ARGS bench gemm --backend cpu --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml)
keel_cli_test(NAME gemm_missing_model EXIT nonzero MATCH "keel: error: .*no-such.yaml"
  ARGS bench gemm --backend cpu --model no-such.yaml --step-tokens 64)
keel_cli_test(NAME gemm_bad_layout EXIT nonzero MATCH "unknown --layout 'xy'" ARGS bench gemm --backend cpu --layout xy)
if(KEEL_HAVE_CUDA)
  # Built with CUDA but run where there is no GPU (CI): a clear error, not a crash.
  keel_cli_test(NAME gemm_cuda_without_gpu EXIT nonzero MATCH "no CUDA device is visible|fp8 needs --layout nt"
    ARGS bench gemm --backend cuda --dtype fp8 --shapes 256x256x256 --layout nn --tune-cache none)
endif()
# A model dimension given as 0 or less is an error naming the flag (it used to read as "not given").
keel_cli_test(NAME gemm_negative_heads EXIT 1 MATCH "keel: error: --heads must be positive, got -2"
  ARGS bench gemm --backend cpu --hidden 256 --ffn 128 --step-tokens 64 --heads -2)
keel_cli_test(NAME gemm_zero_head_dim EXIT 1 MATCH "keel: error: --head-dim must be positive, got 0"
  ARGS bench gemm --backend cpu --hidden 256 --ffn 128 --step-tokens 64 --head-dim 0)
keel_cli_test(NAME gemm_negative_kv_heads EXIT 1 MATCH "keel: error: --kv-heads must be positive, got -7"
  ARGS bench gemm --backend cpu --hidden 256 --ffn 128 --step-tokens 64 --kv-heads -7)
keel_cli_test(NAME gemm_negative_vocab EXIT 1 MATCH "keel: error: --vocab must be positive, got -5"
  ARGS bench gemm --backend cpu --hidden 256 --ffn 128 --step-tokens 64 --vocab -5)
keel_cli_test(NAME gemm_zero_tokens EXIT 1 MATCH "keel: error: --step-tokens must be positive, got 0"
  ARGS bench gemm --backend cpu --step-tokens 0)
# --tokens meant three things in keel (here tokens per step; in keel size tokens to train; in keel
# data inspect tokens to show): the old spelling still works with one deprecation line, and an
# error names the flag as it was typed.
keel_cli_test(NAME gemm_old_tokens_spelling MATCH "^keel: warning: bench gemm: --tokens is deprecated, use --step-tokens"
  ARGS bench gemm ${gemmq} --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --tokens 128 --forward-only)
keel_cli_test(NAME gemm_old_tokens_zero EXIT 1 MATCH "keel: error: --tokens must be positive, got 0"
  ARGS bench gemm --backend cpu --tokens 0)
keel_cli_test(NAME gemm_old_and_new_tokens EXIT 1
  MATCH "^keel: error: bench gemm: --step-tokens and the old --tokens both given: give --step-tokens only$"
  ARGS bench gemm --backend cpu --step-tokens 64 --tokens 64)
