# `keel generate` as a user runs it: train the tiny config for a few steps, then generate from
# its checkpoint (text and the latency table at two batch sizes); a fresh ZAYA1-tiny from its
# model YAML (CCA caches, MLP router); one clear error line per bad input.
set(gen_train_args train ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml --set data.datasets.stories=train_stories
    --set steps=4 --set log_interval=2 --set schedule.warmup_steps=2 --set data.seq_length=64
    --set batch.micro_batch=2 --set eval.prefix=train_stories_heldout --set eval.interval=4 --set output_dir=gen_train)
add_test(NAME cli_generate_clean COMMAND ${CMAKE_COMMAND} -E rm -rf gen_train gen_zaya WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_generate_clean PROPERTIES FIXTURES_SETUP generate_clean)
keel_cli_test(NAME generate_train MATCH "done: steps 0 -> 4 in" ARGS ${gen_train_args})
# train_stories: the tokenized corpus of tests/train/cli_tests.cmake.
set_tests_properties(cli_generate_train PROPERTIES FIXTURES_REQUIRED "train_stories;generate_clean"
                     FIXTURES_SETUP generate_ckpt)

# (expect.sh greps line by line: one line's regex per test.)
set(gen_args generate gen_train --prompt "Once upon a time" --max-new-tokens 12 --batch 1,4 --ignore-eos)
keel_cli_test(NAME generate_from_checkpoint MATCH "^model moe-tiny: 4 layers \\(gqa\\), .*. checkpoint gen_train/step_00000004 \\(step 4\\)$"
  ARGS ${gen_args})
keel_cli_test(NAME generate_text MATCH "^--- sequence 0 of batch 1: prompt \\+ 12 generated tokens ---$" ARGS ${gen_args})
# The latency row at batch 4: prompt 16 tokens, 11 decode steps after the prefill's token.
keel_cli_test(NAME generate_latency_table MATCH "^ +4 +16 +11 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$"
  ARGS ${gen_args})
keel_cli_test(NAME generate_sampling MATCH "^tokenizer byte. prompt 7 tokens. up to 8 new tokens, temperature 0.8, top-k 20, seed 7$"
  ARGS generate gen_train --prompt "The dog" --max-new-tokens 8 -t 0.8 --top-k 20 --seed 7)
keel_cli_test(NAME generate_checkpoint_other_model EXIT 1
  MATCH "^keel: error: checkpoint gen_train/step_00000004 holds model 'moe-tiny' \\(4 layers, hidden [0-9]+\\), not the model 'zaya1-tiny' given with it: [a-z_]+ is .* in the checkpoint, .* given$"
  ARGS generate gen_train --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt hi)
# Another head layout with the same parameter count (so the same float total): still not its model.
keel_cli_test(NAME generate_checkpoint_other_heads EXIT 1
  MATCH "^keel: error: checkpoint gen_train/step_00000004 holds model 'moe-tiny' .*, not the model 'moe-tiny' given with it: heads is 4 in the checkpoint, 8 given$"
  ARGS generate gen_train --model ${CMAKE_CURRENT_SOURCE_DIR}/generate/moe-tiny-8-heads.yaml --prompt hi)
# --max-new-tokens 1: no decode step ran, so the decode columns say "-", not a 0 that reads as a time.
keel_cli_test(NAME generate_no_decode_step MATCH "^ +1 +4 +0 +[0-9.]+ +[0-9.]+ +- +- +- +[0-9.]+$"
  ARGS generate gen_train --prompt "Once" --max-new-tokens 1)
set_tests_properties(cli_generate_checkpoint_other_model cli_generate_checkpoint_other_heads cli_generate_no_decode_step
                     cli_generate_from_checkpoint cli_generate_text cli_generate_latency_table cli_generate_sampling
                     PROPERTIES FIXTURES_REQUIRED generate_ckpt)

# ZAYA1 from a checkpoint: CCA's small cache and the MLP router's biases come back from it.
keel_cli_test(NAME generate_zaya1_train MATCH "done: steps 0 -> 2 in"
  ARGS train ${PROJECT_SOURCE_DIR}/configs/train/zaya1-tiny.yaml --set data.datasets.stories=train_stories
       --set steps=2 --set log_interval=1 --set schedule.warmup_steps=1 --set data.seq_length=64
       --set batch.micro_batch=2 --set eval.prefix=train_stories_heldout --set eval.interval=2 --set output_dir=gen_zaya)
set_tests_properties(cli_generate_zaya1_train PROPERTIES FIXTURES_REQUIRED "train_stories;generate_clean"
                     FIXTURES_SETUP generate_zaya_ckpt)
keel_cli_test(NAME generate_zaya1_from_checkpoint MATCH "^ +2 +7 +7 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$"
  ARGS generate gen_zaya --prompt "Tom ran" --max-new-tokens 8 --batch 1,2 --ignore-eos)
set_tests_properties(cli_generate_zaya1_from_checkpoint PROPERTIES FIXTURES_REQUIRED generate_zaya_ckpt)

keel_cli_test(NAME generate_zaya1_fresh
  MATCH "model zaya1-tiny: 2 layers \\(cca\\), 2 MoE layers of 4 experts top-1 \\(MLP router, skip class\\). fresh init"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "hello" --max-new-tokens 6 --batch 1,2 --ignore-eos)

# Bad input.
# --print-ids: the prompt's byte ids ("hello" = 104 101 108 108 111), then the 6 generated ids.
keel_cli_test(NAME generate_print_ids MATCH "^ids: 104 101 108 108 111( [0-9]+){6}$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "hello" --max-new-tokens 6 --ignore-eos
       --device cpu --print-ids)
keel_cli_test(NAME generate_not_a_checkpoint EXIT 1 MATCH "^keel: error: generate: no_such_dir is not a keel checkpoint"
  ARGS generate no_such_dir --prompt hi)
keel_cli_test(NAME generate_no_model EXIT 1 MATCH "^keel: error: generate: give a model: a checkpoint directory, --model"
  ARGS generate --prompt hi)
keel_cli_test(NAME generate_model_and_config EXIT 1 MATCH "^keel: error: generate: give --model or --config, not both$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --config ${PROJECT_SOURCE_DIR}/configs/train/zaya1-tiny.yaml --prompt hi)
keel_cli_test(NAME generate_bad_temperature EXIT 1 MATCH "^keel: error: generate: --temperature must be a finite number >= 0, got -1$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml -t -1)
keel_cli_test(NAME generate_nan_temperature EXIT 1 MATCH "^keel: error: generate: --temperature must be a finite number >= 0, got nan$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml -t nan)
keel_cli_test(NAME generate_top_k_greedy EXIT 1 MATCH "^keel: error: generate: --top-k applies to sampling, but temperature 0 is greedy"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --top-k 5)
keel_cli_test(NAME generate_nan_init_std EXIT 1 MATCH "^keel: error: generate: --init-std must be a finite number in \\[0, 1\\], got nan$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --init-std nan)
keel_cli_test(NAME generate_huge_init_std EXIT 1 MATCH "^keel: error: generate: --init-std must be a finite number in \\[0, 1\\], got 1e\\+30$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --init-std 1e30)
# A directory where a file is expected: one line naming it (an ifstream read it as empty text).
keel_cli_test(NAME generate_prompt_file_directory EXIT 1 MATCH "^keel: error: cannot read \\.: Is a directory$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt-file . --max-new-tokens 2)
keel_cli_test(NAME generate_model_directory EXIT 1 MATCH "^keel: error: generate: --model \\.: Is a directory \\(expected a file\\)$"
  ARGS generate --model . --max-new-tokens 2)
keel_cli_test(NAME generate_tokenizer_directory EXIT 1 MATCH "^keel: error: generate: --tokenizer spm:\\.: Is a directory \\(expected a file\\)$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --tokenizer spm:. --max-new-tokens 2)
# NUL and other control bytes print escaped, not cut off at the first NUL.
keel_cli_test(NAME generate_nul_bytes MATCH "^a\\\\x00b\\\\x00c"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt-file ${CMAKE_CURRENT_SOURCE_DIR}/generate/nul_prompt.txt --max-new-tokens 2 --ignore-eos)
# A batch no memory holds: one line up front with the size, not std::bad_alloc mid-run.
keel_cli_test(NAME generate_batch_too_large EXIT 1
  MATCH "^keel: error: generate: batch 2000000000 x 6 positions needs at least [0-9.]+ GiB \\(KV cache [0-9.]+ GiB, logits and activations [0-9.]+ GiB\\), more than this machine's"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt hello --max-new-tokens 2 --batch 2000000000 --bench)
keel_cli_test(NAME generate_too_long EXIT 1 MATCH "^keel: error: generate: prompt \\+ new tokens = 304 positions exceeds model 'zaya1-tiny' max_seq_len 256"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt hello --max-new-tokens 300)

# --device and --bench. (The GPU path's own checks are tests/generate/generate_cuda_test.cc;
# with --device auto the runs above take it where a GPU is visible.)
keel_cli_test(NAME generate_device_cpu MATCH "^device cpu \\(fp32 weights and caches\\)$"
  ARGS generate gen_train --prompt "Once" --max-new-tokens 4 --device cpu)
keel_cli_test(NAME generate_bench MATCH "^ +2 +4 +5 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$"
  ARGS generate gen_train --prompt "Once" --max-new-tokens 6 --batch 1,2 --bench)
keel_cli_test(NAME generate_bench_no_text NOT "^--- sequence" MATCH "EOS ignored"
  ARGS generate gen_train --prompt "Once" --max-new-tokens 6 --bench)
set_tests_properties(cli_generate_device_cpu cli_generate_bench cli_generate_bench_no_text
                     PROPERTIES FIXTURES_REQUIRED generate_ckpt)
keel_cli_test(NAME generate_bad_device EXIT 1 MATCH "^keel: error: generate: --device must be auto, cpu or cuda, got 'tpu'$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --device tpu)
# --device cuda: the GPU path where there is one, else one clear error line (no GPU, or no CUDA).
keel_cli_test(NAME generate_device_cuda EXIT any
  MATCH "^(device cuda: .* \\(bf16 weights .* MiB, bf16 caches\\)|keel: error: generate: --device cuda: .*)$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "hello" --max-new-tokens 4 --batch 1,2 --device cuda)

# The old short spellings: -n and -b are keel bench's --iters and --min (as in nccl-tests), so
# generate takes --max-new-tokens and --batch; -n and -b still work with one deprecation line each.
set(gen_old generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "hello" -n 6 -b 1,2 --bench --device cpu)
keel_cli_test(NAME generate_old_n_spelling
  MATCH "^keel: warning: generate: -n is deprecated, use --max-new-tokens \\(-n is --iters in keel bench\\)$" ARGS ${gen_old})
keel_cli_test(NAME generate_old_b_spelling
  MATCH "^keel: warning: generate: -b is deprecated, use --batch \\(-b is --min in keel bench\\)$" ARGS ${gen_old})
# ... and still mean what they meant: batch 2, 6 new tokens (5 decode steps after the prefill's).
keel_cli_test(NAME generate_old_spellings_still_work MATCH "^ +2 +5 +5 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$"
  ARGS ${gen_old})
keel_cli_test(NAME generate_new_spellings_no_warning MATCH "^ +2 +5 +5 " NOT "keel: warning"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "hello" --max-new-tokens 6 --batch 1,2 --bench
       --device cpu)
keel_cli_test(NAME generate_old_and_new_n EXIT 1
  MATCH "^keel: error: generate: --max-new-tokens and the old -n both given: give --max-new-tokens only$"
  ARGS generate --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "hello" -n 6 --max-new-tokens 4)
