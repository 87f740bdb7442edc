# `keel size` as a user runs it. Published figures are checked in tests/model/params_test.cc;
# here: the report's sections, the outputs, and one clear error line per bad input. ZAYA1-8B is
# sized as it was pretrained, at 4,096 tokens (configs/zaya1-8b.yaml is the release: 131,072).
set(cfg ${PROJECT_SOURCE_DIR}/configs)
set(data ${CMAKE_CURRENT_SOURCE_DIR}/size/data)

keel_cli_test(NAME size_zaya1 MATCH "non-embedding +8\\.30B +753\\.6M"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware mi300x --gpus 1024 --train-tokens 12T --micro-batch 4)
keel_cli_test(NAME size_zaya1_sections MATCH "## Sizing findings"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware h200 --layout tp=2,ep=4,zero=2 --gpus 64)
keel_cli_test(NAME size_zaya1_time MATCH "12\\.00T tokens on 1024 GPUs: [0-9.]+ days at 40% MFU"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware mi300x --gpus 1024 --train-tokens 12T)
# --tokens meant three things in keel (here tokens to train; in keel bench gemm tokens per step;
# in keel data inspect tokens to show): the old spelling still works, with one deprecation line.
keel_cli_test(NAME size_old_tokens_spelling MATCH "^keel: warning: size: --tokens is deprecated, use --train-tokens"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware mi300x --gpus 1024 --tokens 12T)
keel_cli_test(NAME size_old_tokens_still_trains MATCH "12\\.00T tokens on 1024 GPUs: [0-9.]+ days at 40% MFU"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware mi300x --gpus 1024 --tokens 12T)
keel_cli_test(NAME size_old_and_new_tokens EXIT 1
  MATCH "^keel: error: size: --train-tokens and the old --tokens both given: give --train-tokens only$"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --tokens 1T --train-tokens 2T)
# The layout as the report prints it (mesh::Shape::str: dp always, other axes when not 1, zero
# when not 0; ZeRO-1 when --layout leaves zero out).
keel_cli_test(NAME size_layout_line MATCH "^#   layout pp=4,dp=8,tp=2,ep=8,zero=1 on 64 GPUs, "
  ARGS size ${cfg}/mixtral-8x7b.yaml --hardware h100 --layout tp=2,ep=8,pp=4 --gpus 64)
keel_cli_test(NAME size_layout_zero0_line MATCH "^#   layout dp=4,tp=2 on 8 GPUs, "
  ARGS size ${cfg}/llama3-8b.yaml --hardware h100 --layout tp=2,zero=0 --gpus 8)
# Tensor parallelism with or without sequence parallelism (keel train's parallel.sequence)
keel_cli_test(NAME size_layout_sequence_parallel MATCH "^#   layout dp=4,tp=2,zero=1 on 8 GPUs, .*, AdamW, sequence parallel$"
  ARGS size ${cfg}/llama3-8b.yaml --hardware h100 --layout tp=2 --gpus 8)
keel_cli_test(NAME size_layout_no_sequence_parallel
  MATCH "^## Memory per GPU \\(dp=4,tp=2,zero=1, no sequence parallelism."
  ARGS size ${cfg}/llama3-8b.yaml --hardware h100 --layout tp=2 --gpus 8 --no-sequence-parallel)
keel_cli_test(NAME size_mixtral MATCH "with embeddings +46\\.70B +12\\.88B"
  ARGS size ${cfg}/mixtral-8x7b.yaml --hardware h100 --layout tp=2,ep=8,pp=4 --gpus 64 --recompute full)
keel_cli_test(NAME size_llama3 MATCH "with embeddings +8\\.03B"
  ARGS size ${cfg}/llama3-8b.yaml --hardware a100 --gpus 8 --optimizer muon)
# ZAYA1's 40 layers: 501 TFLOP of Newton-Schulz a step, on one GPU most of a 4K-token step
keel_cli_test(NAME size_muon_step MATCH "Newton-Schulz per optimizer step \\(4\\.1K tokens: micro-batches 1 x dp 1\\): 501 TFLOP whole model.*amortize"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware h200 --gpus 1 --optimizer muon)
# keel train's own ZeRO-1 cuts on a layout it runs: the busiest rank, and its bf16 reduce scratch
keel_cli_test(NAME size_keel_train_shards MATCH "busiest rank's optimizer shard is [0-9.]+M floats, \\+[0-9.]+% on the mean"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware h200 --gpus 1024 --optimizer muon)
keel_cli_test(NAME size_keel_train_muon MATCH "Newton-Schulz.* on the busiest GPU \\(keel train's ZeRO-1 cuts\\)"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware h200 --gpus 1024 --optimizer muon)
keel_cli_test(NAME size_grad_reduce_bf16 MATCH "gradient reduce scratch \\(bf16\\) +1\\.00 GiB"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware h200 --gpus 8 --grad-reduce bf16)
keel_cli_test(NAME size_olmoe MATCH "with embeddings +6\\.92B +1\\.28B"
  ARGS size ${cfg}/olmoe-1b-7b.yaml --hardware b200 --gpus 8 --layout ep=8)
keel_cli_test(NAME size_lasp2_hybrid MATCH "linear_attention"
  ARGS size ${cfg}/lasp2-hybrid-1b.yaml --hardware mi325x --layout cp=4 --gpus 32)
keel_cli_test(NAME size_swiglu_finding MATCH "width 10922 -> 10944: predicted \\+[0-9]+%"
  ARGS size ${data}/swiglu_10922.yaml --hardware h100 --gpus 8)
keel_cli_test(NAME size_vocab_finding MATCH "vocab_size 50257 -> 50304"
  ARGS size ${data}/swiglu_10922.yaml --hardware h100 --gpus 8)
keel_cli_test(NAME size_moe_study MATCH "16 +1 +2048 .*<- config"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware mi300x --gpus 8 --moe-study --moe-experts 8,16,32 --moe-top-k 1,2)
add_test(NAME cli_size_outputs_files
  COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/size/check_outputs.sh $<TARGET_FILE:keel> ${cfg})
set_tests_properties(cli_size_outputs_files PROPERTIES TIMEOUT 120)

# Bad input: one line naming what is wrong, exit 1.
keel_cli_test(NAME size_unknown_key EXIT 1 MATCH "keel: error: .*unknown_key\\.yaml: unknown key 'num_experts' \\(line 6\\)"
  ARGS size ${data}/unknown_key.yaml)
keel_cli_test(NAME size_topk_above_experts EXIT 1 MATCH "keel: error: .*'top_k' \\(6\\) is larger than 'experts' \\(4\\)"
  ARGS size ${data}/topk_above_experts.yaml)
keel_cli_test(NAME size_heads_not_dividing EXIT 1 MATCH "keel: error: .*'heads' \\(16\\) does not divide 'hidden' \\(1000\\)"
  ARGS size ${data}/heads_not_dividing.yaml)
keel_cli_test(NAME size_layout_indivisible EXIT 1 MATCH "keel: error: layout 'tp=4,pp=3': pp\\*cp\\*tsp\\*tp = 12 does not divide the 64 ranks"
  ARGS size ${cfg}/llama3-8b.yaml --layout tp=4,pp=3 --gpus 64)
keel_cli_test(NAME size_layout_gpus EXIT 1
  MATCH "keel: error: layout 'dp=4,tp=2' spans 8 ranks \\(pp\\*dp\\*cp\\*tsp\\*tp\\), but there are 16"
  ARGS size ${cfg}/llama3-8b.yaml --layout dp=4,tp=2 --gpus 16)
# ep is folded into dp*cp (as keel train runs it): it takes no GPUs of its own and must divide dp*cp.
keel_cli_test(NAME size_layout_ep_folded EXIT 1
  MATCH "keel: error: layout 'ep=8': ep=8 does not divide dp\\*cp = 4 \\(expert parallelism is folded into the data and context ranks\\)"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --layout ep=8 --gpus 4)
keel_cli_test(NAME size_layout_ep EXIT 1 MATCH "keel: error: --layout: ep=3 does not divide experts \\(16\\)"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --layout ep=3 --gpus 6)
keel_cli_test(NAME size_layout_key EXIT 1 MATCH "keel: error: layout 'mp=2': unknown axis 'mp'"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --layout mp=2)
keel_cli_test(NAME size_unknown_hardware EXIT 1 MATCH "keel: error: unknown hardware 'v100'"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --hardware v100)
keel_cli_test(NAME size_missing_config EXIT 1 MATCH "^keel: error: cannot read /nonexistent\\.yaml: No such file or directory$"
  ARGS size /nonexistent.yaml)
keel_cli_test(NAME size_bad_grad_reduce EXIT 1 MATCH "keel: error: unknown --grad-reduce 'fp16' \\(choose fp32 or bf16\\)"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --grad-reduce fp16)
keel_cli_test(NAME size_bad_tokens EXIT 1 MATCH "keel: error: --train-tokens '12X' has an unknown unit"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --train-tokens 12X)
keel_cli_test(NAME size_bad_old_tokens EXIT 1 MATCH "keel: error: --tokens '12X' has an unknown unit"
  ARGS size ${cfg}/zaya1-8b.yaml --seq 4096 --tokens 12X)
keel_cli_test(NAME size_moe_study_dense EXIT 1 MATCH "keel: error: --moe-study needs an MoE model"
  ARGS size ${cfg}/llama3-8b.yaml --moe-study)
# A flag given as 0 is not "left out": one line naming it (it used to run "on 1 GPUs").
keel_cli_test(NAME size_zero_gpus EXIT 1 MATCH "keel: error: --gpus must be at least 1 \\(got 0\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --gpus 0)
keel_cli_test(NAME size_zero_seq EXIT 1 MATCH "keel: error: --seq must be at least 1 \\(got 0\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --seq 0)
keel_cli_test(NAME size_zero_micro_batches EXIT 1 MATCH "keel: error: --micro-batches must be at least 1 \\(got 0\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --layout pp=4 --gpus 4 --micro-batches 0)
# Sizes past int64 are an error naming the component, not a row that vanishes.
keel_cli_test(NAME size_experts_overflow EXIT 1
  MATCH "keel: error: model 'mixtral-8x7b': parameter count of 'experts' overflows int64"
  ARGS size ${data}/experts_overflow.yaml)
keel_cli_test(NAME size_tokens_overflow EXIT 1
  MATCH "keel: error: tokens per micro-batch \\(--micro-batch x --seq\\) overflows int64"
  ARGS size ${cfg}/mixtral-8x7b.yaml --seq 9000000000000000000 --micro-batch 2)
# Impossible measurements in a keel bench JSON: one line naming the file and the field.
keel_cli_test(NAME size_hw_negative_busbw EXIT 1
  MATCH "keel: error: .*comm_negative_busbw\\.json: out_of_place\\.busbw_gbps must be a measurement in .* \\(got -3\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --hardware ${data}/comm_negative_busbw.json)
keel_cli_test(NAME size_hw_zero_tflops EXIT 1
  MATCH "keel: error: .*gemm_zero_tflops\\.json: results\\[0\\]\\.tflops must be a measurement in .* \\(got 0\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --hardware ${data}/gemm_zero_tflops.json --train-tokens 1T)
keel_cli_test(NAME size_hw_tiny_tflops EXIT 1
  MATCH "keel: error: .*gemm_tiny_tflops\\.json: results\\[0\\]\\.tflops must be a measurement in .* \\(got 1e-300\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --hardware ${data}/gemm_tiny_tflops.json --train-tokens 1T)
keel_cli_test(NAME size_hw_sm_count_wraps EXIT 1
  MATCH "keel: error: .*mem_sm_count_wraps\\.json: devices\\[0\\]\\.sm_count must be a whole number in \\[1, 65536\\] \\(got 4294967297\\)"
  ARGS size ${cfg}/mixtral-8x7b.yaml --hardware ${data}/mem_sm_count_wraps.json)
# --context-mode names the cp buffers keel train holds in each mode; a bad word is one line.
keel_cli_test(NAME size_context_mode_ring MATCH "context-parallel ring blocks \\(one layer\\)"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout cp=2 --seq 65536 --context-mode ring)
keel_cli_test(NAME size_context_mode_typo EXIT 1
  MATCH "^keel: error: --context-mode: unknown context mode 'rnig' \\(allgather, ring, alltoall or auto\\)$"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout cp=2 --context-mode rnig)
# --tsp-tables as keel train's parallel.tsp_tables; a bad word is one line.
keel_cli_test(NAME size_tsp_tables_gather MATCH "TSP table gathers"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout tsp=2 --seq 32768 --tsp-tables gather)
keel_cli_test(NAME size_tsp_tables_sweep NOT "TSP table gathers"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout tsp=2 --seq 32768 --tsp-tables sweep)
keel_cli_test(NAME size_tsp_ring MATCH "TSP k/v ring blocks \\(one layer, one shard's heads\\)"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout tsp=2 --seq 32768 --context-mode ring)
keel_cli_test(NAME size_tsp_alltoall EXIT 1
  MATCH "^keel: error: --context-mode alltoall is context parallelism's. under tsp keel train takes allgather or ring$"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout tsp=2 --context-mode alltoall)
keel_cli_test(NAME size_tsp_tables_typo EXIT 1
  MATCH "^keel: error: --tsp-tables: 'gahter' \\(must be auto, sweep or gather\\)$"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout tsp=2 --tsp-tables gahter)
# auto: the ring for a model of softmax / CCA layers (ZAYA1), the all-gather with linear layers
keel_cli_test(NAME size_context_mode_auto_ring MATCH "context-parallel ring blocks \\(one layer\\)"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/zaya1-8b.yaml --layout cp=2 --seq 65536 --context-mode auto)
keel_cli_test(NAME size_context_mode_auto_lasp2 MATCH "context-parallel k/v gathers \\(one layer\\)"
  ARGS size ${PROJECT_SOURCE_DIR}/configs/lasp2-hybrid-1b.yaml --layout cp=2 --seq 65536 --context-mode auto)
