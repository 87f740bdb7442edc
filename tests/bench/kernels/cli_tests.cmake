# `keel bench kernels` (src/bench/kernels): bad words are refused by name before any GPU work; on
# a machine without a GPU it says so; with one, a small run of every kernel prints its rows.
keel_cli_test(NAME kernels_unknown_kernel EXIT 1
  MATCH "^keel: error: bench kernels: --what 'attn' is not a kernel \\(attention, experts, ce\\)$"
  ARGS bench kernels --what attn)
keel_cli_test(NAME kernels_bad_heads EXIT 1
  MATCH "^keel: error: bench kernels: --heads '16:3' is not QUERY:KV with KV dividing QUERY \\(e.g. 16:2\\)$"
  ARGS bench kernels --heads 16:3)
keel_cli_test(NAME kernels_uneven_experts EXIT 1
  MATCH "the experts must divide the tokens"
  ARGS bench kernels --what experts --tokens 100 --experts 16)
keel_cli_test(NAME kernels_no_gpu EXIT 1 GPUS 0
  MATCH "^keel: error: bench kernels: (no CUDA device is visible|this keel was built without CUDA)"
  ARGS bench kernels --what ce)
keel_cli_test(NAME kernels_small_gpu GPUS 1+
  MATCH "^ce +256 tokens, 64 -> 1000 vocab, chunked"
  ARGS bench kernels --batch 1 --seq 256 --heads 4:2 --tokens 256 --dim 64 --ffn 128 --experts 4 --vocab 1000 -n 2 -w 1)
