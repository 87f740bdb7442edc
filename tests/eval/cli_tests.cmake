# `keel eval` as a user runs it: train the tiny config with a held-out eval set, score its
# checkpoints without training, and require keel train's eval loss back; one clear error line
# per bad input. The corpus comes from the train_stories fixture (tests/train/cli_tests.cmake).
set(echeck python3 ${CMAKE_CURRENT_SOURCE_DIR}/eval/eval_check.py)

add_test(NAME cli_eval_outputs_clean COMMAND ${CMAKE_COMMAND} -E rm -rf eval_run eval_lp.tsv eval_badvocab.idx
         eval_badvocab.bin eval_short.idx eval_short.bin WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_eval_outputs_clean PROPERTIES FIXTURES_SETUP eval_outputs_clean)
# 8 steps, an eval and a checkpoint every 4: two checkpoints whose eval loss metrics.jsonl holds
# (device auto: a GPU where there is one, and keel eval's auto picks the same backend).
keel_cli_test(NAME eval_train MATCH "eval +8 \\| loss [0-9]+\\.[0-9]+"
  ARGS train ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml --set data.datasets.stories=train_stories --set steps=8
       --set log_interval=4 --set schedule.warmup_steps=2 --set data.seq_length=64 --set batch.micro_batch=4
       --set eval.prefix=train_stories_heldout --set eval.interval=4 --set checkpoint.interval=4 --set output_dir=eval_run)
set_tests_properties(cli_eval_train PROPERTIES FIXTURES_REQUIRED "train_stories;eval_outputs_clean" FIXTURES_SETUP eval_run)

# keel eval STEP_DIR (keel train's eval samples) = the eval_loss keel train logged at that step, 1e-4 relative.
add_test(NAME cli_eval_agrees_with_train COMMAND ${echeck} agree $<TARGET_FILE:keel> eval_run
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
# The per-token log-probabilities (CPU) average to the printed CE; one row per scored token.
add_test(NAME cli_eval_logprobs COMMAND ${echeck} logprobs $<TARGET_FILE:keel> eval_run train_stories_heldout eval_lp.tsv
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
# --data: the dataset in order, windows of seq_length + 1 (the checkpoint's 64), --max-batches of them.
keel_cli_test(NAME eval_data_in_order MATCH "eval: 512 tokens in 2 batches: mean CE [0-9]+\\.[0-9]+, perplexity [0-9.]+ \\("
  ARGS eval eval_run --data train_stories_heldout --max-batches 2)
keel_cli_test(NAME eval_missing_checkpoint EXIT 1 MATCH "^keel: error: eval: checkpoint eval_nowhere: No such file or directory$"
  ARGS eval eval_nowhere)
keel_cli_test(NAME eval_missing_data EXIT 1 MATCH "^keel: error: eval: cannot open eval_nodata.idx"
  ARGS eval eval_run --data eval_nodata)
set_tests_properties(cli_eval_agrees_with_train cli_eval_logprobs cli_eval_data_in_order cli_eval_missing_data
                     PROPERTIES FIXTURES_REQUIRED "train_stories;eval_run" ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 300)

# A dataset with a token id past the model's vocabulary (264), and one shorter than a window.
add_test(NAME cli_eval_make_bad_vocab COMMAND ${echeck} bad-vocab eval_badvocab 300 WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
add_test(NAME cli_eval_make_short COMMAND ${echeck} bad-vocab eval_short 7 50 WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_eval_make_bad_vocab cli_eval_make_short PROPERTIES FIXTURES_REQUIRED eval_outputs_clean FIXTURES_SETUP eval_badvocab)
keel_cli_test(NAME eval_bad_vocab EXIT 1
  MATCH "^keel: error: eval: dataset eval_badvocab: window 1 holds token id 300, outside the vocabulary of model 'moe-tiny' \\(264\\)"
  ARGS eval eval_run --data eval_badvocab)
keel_cli_test(NAME eval_data_too_short EXIT 1
  MATCH "^keel: error: eval: dataset eval_short holds 50 tokens, fewer than one window of seq_length \\+ 1 = 65$"
  ARGS eval eval_run --data eval_short)
set_tests_properties(cli_eval_bad_vocab cli_eval_data_too_short PROPERTIES FIXTURES_REQUIRED "eval_run;eval_badvocab")
# Per-token values come from the CPU path: on a GPU, one line that says so.
keel_cli_test(NAME eval_logprobs_on_gpu_refused EXIT 1 GPUS "1+" MATCH "^keel: error: eval: --logprobs is computed on the CPU path only"
  ARGS eval eval_run --device cuda --logprobs eval_gpu.tsv)
set_tests_properties(cli_eval_logprobs_on_gpu_refused PROPERTIES FIXTURES_REQUIRED eval_run)
