# `keel train` as a user runs it: tokenize the shipped corpus, train the tiny config briefly,
# stop and resume; one clear error line per bad input.
set(tcfg ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml)
set(tshort --set data.datasets.stories=train_stories --set steps=16 --set log_interval=8 --set schedule.warmup_steps=4
    --set data.seq_length=64 --set batch.micro_batch=4 --set eval.prefix=train_stories_heldout --set eval.interval=8)

# 5% of the documents held out (by a hash of their position: the same split on every machine).
keel_cli_test(NAME train_tokenize MATCH "held out 13 documents, [0-9]+ tokens \\(--holdout 0.05\\)"
  ARGS data tokenize ${PROJECT_SOURCE_DIR}/data/corpus/stories.jsonl --out train_stories --append-eos --holdout 0.05 --force)
set_tests_properties(cli_train_tokenize PROPERTIES FIXTURES_SETUP train_stories)

keel_cli_test(NAME train_tiny MATCH "done: steps 0 -> 16 in .* s, loss 5\\.[0-9]+ -> "
  ARGS train ${tcfg} ${tshort} --set output_dir=train_out)
keel_cli_test(NAME train_eval_heldout MATCH "eval +8 \\| loss [0-9]+\\.[0-9]+"
  ARGS train ${tcfg} ${tshort} --set steps=8 --set output_dir=train_eval)
set_tests_properties(cli_train_eval_heldout PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# The start-up memory line: the backend's holdings by what holds them (the CPU backend's items:
# device pinned, so the test means the same on a machine with a GPU).
keel_cli_test(NAME train_memory_report
  MATCH "memory on this rank: [0-9.]+ GiB = parameters [0-9.]+ GiB \\+ gradients [0-9.]+ GiB \\+ optimizer state [0-9.]+ GiB \\+ activations and scratch"
  ARGS train ${tcfg} ${tshort} --set steps=4 --set output_dir=train_memory --set device=cpu)
set_tests_properties(cli_train_memory_report PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# router.forced_balance (benchmarking only) is said on the start-up line.
keel_cli_test(NAME train_forced_balance MATCH "recompute none, routing forced-balance \\(benchmark only\\)"
  ARGS train ${tcfg} ${tshort} --set steps=4 --set device=cpu --set checkpoint.final=false
       --set output_dir=train_forced_balance --set router.forced_balance=true)
set_tests_properties(cli_train_forced_balance PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# The same line wherever device: auto lands, one rank: the CPU backend's items, or the CUDA
# backend's (fp32 master weights, bf16 weights, fp32 gradients, ...) on a machine with a GPU.
keel_cli_test(NAME train_memory_report_auto
  MATCH "memory on this rank: [0-9.]+ GiB = (parameters [0-9.]+ GiB \\+ gradients [0-9.]+ GiB|fp32 master weights [0-9.]+ GiB \\+ bf16 weights [0-9.]+ GiB \\+ fp32 gradients [0-9.]+ GiB)"
  ARGS train ${tcfg} ${tshort} --set steps=4 --set checkpoint.final=false --set output_dir=train_memory_auto)
set_tests_properties(cli_train_memory_report_auto PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# --timeout is the same in every command (common/watchdog.h): seconds, default 600; 0 or inf is no
# deadline (train refused inf before), a negative or NaN value one line.
keel_cli_test(NAME train_timeout_inf MATCH "done: steps 0 -> 4"
  ARGS train ${tcfg} ${tshort} --set steps=4 --set device=cpu --set checkpoint.final=false
       --set output_dir=train_timeout_inf --timeout inf)
set_tests_properties(cli_train_timeout_inf PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_timeout_negative EXIT 1
  MATCH "^keel: error: --timeout -1: must be seconds >= 0 \\(0 or inf: no deadline\\)$"
  ARGS train ${tcfg} --timeout -1)
keel_cli_test(NAME train_stop MATCH "saved train_stop/step_00000008 "
  ARGS train ${tcfg} ${tshort} --set output_dir=train_stop --stop-after 8)
set_tests_properties(cli_train_stop PROPERTIES FIXTURES_SETUP train_stop)
keel_cli_test(NAME train_resume MATCH "resumed from train_stop/step_00000008 at step 8"
  ARGS train ${tcfg} ${tshort} --set output_dir=train_stop --resume train_stop)
set_tests_properties(cli_train_resume PROPERTIES FIXTURES_REQUIRED "train_stories;train_stop")
set_tests_properties(cli_train_tiny PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# The stop/resume pair starts from an empty directory, so a rerun does not find the last run's
# newer checkpoint.
add_test(NAME cli_train_stop_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_stop WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_stop_clean PROPERTIES FIXTURES_SETUP train_stop_clean)
set_tests_properties(cli_train_stop PROPERTIES FIXTURES_REQUIRED "train_stories;train_stop_clean")
# A fresh run into a directory that holds checkpoints is refused before any work.
keel_cli_test(NAME train_refuses_existing_checkpoints EXIT 1 MATCH "already holds checkpoints.*--resume"
  ARGS train ${tcfg} ${tshort} --set output_dir=train_stop)
set_tests_properties(cli_train_refuses_existing_checkpoints PROPERTIES FIXTURES_REQUIRED "train_stories;train_stop")
# Both use train_stop, which the resume writes: one at a time (else the refusal is the run lock's,
# `is in use by another run`, docs/train.md "One run per directory").
set_tests_properties(cli_train_refuses_existing_checkpoints cli_train_resume PROPERTIES RESOURCE_LOCK train_stop_dir)
# --stop-after on a checkpoint.interval step saves that step once and exits 0.
keel_cli_test(NAME train_stop_at_interval MATCH "done: steps 0 -> 8 in"
  ARGS train ${tcfg} ${tshort} --set output_dir=train_stop_iv --set checkpoint.interval=4 --stop-after 8)
set_tests_properties(cli_train_stop_at_interval PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# --stop-after counts steps; a negative count is refused, not read as "run them all".
keel_cli_test(NAME train_stop_after_negative EXIT 1 MATCH "--stop-after -5: must be a step count >= 1"
  ARGS train ${tcfg} ${tshort} --set output_dir=train_never --stop-after -5)
# The other runs write checkpoints too: each starts from an empty directory so reruns work.
add_test(NAME cli_train_outputs_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_out train_eval train_memory train_zaya train_stop_iv train_hang train_hang_ck
         train_dp_auto train_dp_auto1 train_dp_bf16 train_memory_auto train_timeout_inf train_tp_gpu train_tp_gpu_muon
         train_inject_exit train_inject_kill train_inject_nan train_inject_nan_dp train_inject_nan_tp train_inject_slow
         train_forced_balance train_cp_ring train_cp_ring_gpu train_cp_alltoall train_cp_alltoall_gpu train_cp_auto train_tsp2 train_tsp2_gather train_tsp2_ring
         train_tsp2_gpu WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_outputs_clean PROPERTIES FIXTURES_SETUP train_outputs_clean)

# Data parallel (ZeRO-1) on CPU ranks under mpiexec: 2 ranks train and save; one rank resumes
# the 2-rank checkpoint (the optimizer shards are read back as one); bad layouts are refused.
set(tdp ${tshort} --set device=cpu --set batch.grad_accum=2)
# Ranks launched with different configs (an MPMD launch, a stale file on one node) are refused
# before any collective, naming the key, instead of hanging, crashing or training on mixed settings.
add_test(NAME cli_train_ranks_disagree
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/expect.sh 1
                 "ranks disagree on the config: rank 1 has 'optimizer.lr: 0.3' where rank 0 has 'optimizer.lr: 3.0e-3'"
                 -- ${KEEL_MPIEXEC} -n 1 $<TARGET_FILE:keel> train ${tcfg} ${tdp} --set output_dir=train_disagree
                 : -n 1 $<TARGET_FILE:keel> train ${tcfg} ${tdp} --set output_dir=train_disagree --set optimizer.lr=0.3
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_ranks_disagree PROPERTIES ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 120
                     FIXTURES_REQUIRED train_stories)
keel_cli_test(NAME train_dp2_stop NP 2 MATCH "saved train_dp/step_00000004 "
  ARGS train ${tcfg} ${tdp} --set output_dir=train_dp --stop-after 4)
keel_cli_test(NAME train_dp2_resume_on_one MATCH "resumed from train_dp/step_00000004 at step 4"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_dp --set steps=8 --resume train_dp)
add_test(NAME cli_train_dp_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_dp WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_dp_clean PROPERTIES FIXTURES_SETUP train_dp_clean)
set_tests_properties(cli_train_dp2_stop PROPERTIES FIXTURES_REQUIRED "train_stories;train_dp_clean" FIXTURES_SETUP train_dp)
set_tests_properties(cli_train_dp2_resume_on_one PROPERTIES FIXTURES_REQUIRED "train_stories;train_dp")
# Expert parallel on CPU ranks: 2 ranks each holding 2 of the 4 experts train and save (the
# checkpoint stores whole [E, ...] expert tensors); one rank resumes with all 4.
keel_cli_test(NAME train_ep2_stop NP 2 MATCH "x 2 data-parallel ranks \\(ZeRO-1\\), expert parallel 2, "
  ARGS train ${tcfg} ${tdp} --set parallel.expert=2 --set output_dir=train_ep --stop-after 4)
# The layout keel train saves, ep folded into its 2 data ranks: 2 ranks, not 4 (dp x ep).
keel_cli_test(NAME train_ep2_inspect MATCH "saved by 2 ranks in layout dp=2,ep=2,zero=1"
  ARGS ckpt inspect train_ep)
keel_cli_test(NAME train_ep2_resume_on_one MATCH "resumed from train_ep/step_00000004 at step 4 \\(read .* GiB in .*, read amplification 1\\.000\\)"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_ep --set steps=8 --resume train_ep)
add_test(NAME cli_train_ep_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_ep WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_ep_clean PROPERTIES FIXTURES_SETUP train_ep_clean)
set_tests_properties(cli_train_ep2_stop PROPERTIES FIXTURES_REQUIRED "train_stories;train_ep_clean" FIXTURES_SETUP train_ep)
set_tests_properties(cli_train_ep2_inspect cli_train_ep2_resume_on_one PROPERTIES FIXTURES_REQUIRED "train_stories;train_ep")
set_tests_properties(cli_train_ep2_resume_on_one PROPERTIES DEPENDS cli_train_ep2_inspect)
# Tensor parallel with sequence parallelism on CPU ranks: 2 ranks each holding half of every
# layer train and save (whole tensors in the checkpoint); one rank resumes the whole model.
keel_cli_test(NAME train_tp2_stop NP 2 MATCH "on cpu x tensor parallel 2 \\(sequence parallel\\), "
  ARGS train ${tcfg} ${tdp} --set parallel.tensor=2 --set parallel.sequence=true --set output_dir=train_tp --stop-after 4)
keel_cli_test(NAME train_tp2_inspect MATCH "saved by 2 ranks in layout dp=1,tp=2"
  ARGS ckpt inspect train_tp)
keel_cli_test(NAME train_tp2_resume_on_one MATCH "resumed from train_tp/step_00000004 at step 4"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_tp --set steps=8 --resume train_tp)
add_test(NAME cli_train_tp_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_tp WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_tp_clean PROPERTIES FIXTURES_SETUP train_tp_clean)
set_tests_properties(cli_train_tp2_stop PROPERTIES FIXTURES_REQUIRED "train_stories;train_tp_clean" FIXTURES_SETUP train_tp)
set_tests_properties(cli_train_tp2_inspect cli_train_tp2_resume_on_one PROPERTIES FIXTURES_REQUIRED "train_stories;train_tp")
set_tests_properties(cli_train_tp2_resume_on_one PROPERTIES DEPENDS cli_train_tp2_inspect)
keel_cli_test(NAME train_tp_does_not_divide_the_ranks NP 2 EXIT 1
  MATCH "parallel\\.tensor \\(4\\) must divide the number of ranks \\(2\\)"
  ARGS train ${tcfg} ${tdp} --set parallel.tensor=4)
keel_cli_test(NAME train_tp_does_not_split_the_model NP 2 EXIT 1
  MATCH "does not split over tensor-parallel degree 2 \\(parallel\\.tensor\\): the vocabulary of 263 does not divide by 2"
  ARGS train ${tcfg} ${tdp} --set parallel.tensor=2 --set model.vocab_size=263)
# Context parallelism on CPU ranks: each sequence split over 2 ranks (zigzag chunks) trains and
# saves; one rank resumes it with whole sequences; a sequence that does not split is one clear
# error. On 2 GPUs (skipped elsewhere) it trains and says so.
keel_cli_test(NAME train_cp2_stop NP 2 MATCH "on cpu x context parallel 2 \\(zigzag\\) \\(ZeRO-1\\), "
  ARGS train ${tcfg} ${tdp} --set parallel.context=2 --set output_dir=train_cp --stop-after 4)
keel_cli_test(NAME train_cp2_inspect MATCH "saved by 2 ranks in layout dp=1,cp=2,zero=1"
  ARGS ckpt inspect train_cp)
keel_cli_test(NAME train_cp2_resume_on_one MATCH "resumed from train_cp/step_00000004 at step 4"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_cp --set steps=8 --resume train_cp)
add_test(NAME cli_train_cp_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_cp WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_cp_clean PROPERTIES FIXTURES_SETUP train_cp_clean)
set_tests_properties(cli_train_cp2_stop PROPERTIES FIXTURES_REQUIRED "train_stories;train_cp_clean" FIXTURES_SETUP train_cp)
set_tests_properties(cli_train_cp2_inspect cli_train_cp2_resume_on_one PROPERTIES FIXTURES_REQUIRED "train_stories;train_cp")
set_tests_properties(cli_train_cp2_resume_on_one PROPERTIES DEPENDS cli_train_cp2_inspect)
# LASP-2H on CPU ranks: a hybrid (linear attention in layers 0-2, decayed, softmax gqa in layer 3)
# with each sequence over 2 ranks trains, saves, and resumes on one rank with whole sequences.
set(tlasp --set "model.layer_attention=[linear, linear, linear, gqa]" --set model.linear_chunk=16
    --set model.linear_decay=retnet)
keel_cli_test(NAME train_lasp2_cp2_stop NP 2
  MATCH "on cpu x context parallel 2 \\(zigzag. LASP-2H: LASP-2 for the linear layers\\) \\(ZeRO-1\\), "
  ARGS train ${tcfg} ${tdp} ${tlasp} --set parallel.context=2 --set output_dir=train_lasp --stop-after 4)
keel_cli_test(NAME train_lasp2_resume_on_one MATCH "resumed from train_lasp/step_00000004 at step 4"
  ARGS train ${tcfg} ${tdp} ${tlasp} --set output_dir=train_lasp --set steps=6 --resume train_lasp)
add_test(NAME cli_train_lasp_clean COMMAND ${CMAKE_COMMAND} -E rm -rf train_lasp WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_train_lasp_clean PROPERTIES FIXTURES_SETUP train_lasp_clean)
set_tests_properties(cli_train_lasp2_cp2_stop PROPERTIES FIXTURES_REQUIRED "train_stories;train_lasp_clean" FIXTURES_SETUP train_lasp)
set_tests_properties(cli_train_lasp2_resume_on_one PROPERTIES FIXTURES_REQUIRED "train_stories;train_lasp")
# Activations that do not fit one GPU: one line saying what would shrink them, context
# parallelism included (and recompute: full only where it is not set already).
keel_cli_test(NAME train_activations_out_of_gpu_memory GPUS "1+" EXIT 1
  MATCH "out of GPU memory: the activations need .* set recompute: full, or split each sequence over more GPUs \\(parallel\\.context\\)"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set batch.micro_batch=65536 --set output_dir=train_oom_gpu)
keel_cli_test(NAME train_activations_out_of_gpu_memory_recompute GPUS "1+" EXIT 1
  MATCH "lower batch\\.micro_batch or data\\.seq_length, or split each sequence over more GPUs"
  NOT "set recompute: full"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set batch.micro_batch=262144 --set recompute=full
       --set output_dir=train_oom_gpu_full)
set_tests_properties(cli_train_activations_out_of_gpu_memory cli_train_activations_out_of_gpu_memory_recompute
                     PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_cp_sequence_does_not_split NP 2 EXIT 1
  MATCH "tiny\\.yaml: seq_length 65 does not split over context-parallel degree 2 \\(parallel\\.context\\)"
  ARGS train ${tcfg} ${tdp} --set parallel.context=2 --set data.seq_length=65)
keel_cli_test(NAME train_cp_bad_degree EXIT 1 MATCH "parallel\\.context.*must be >= 1"
  ARGS train ${tcfg} ${tdp} --set parallel.context=0)
# The ring mode (parallel.context_mode: ring) on 2 CPU ranks trains and says so; a bad word is one
# line; on GPUs (skipped elsewhere) it is refused with one line pointing at the all-gather.
keel_cli_test(NAME train_cp2_ring NP 2 MATCH "on cpu x context parallel 2 \\(zigzag, k/v ring\\) \\(ZeRO-1\\), "
  ARGS train ${tcfg} ${tshort} --set device=cpu --set parallel.context=2 --set parallel.context_mode=ring
       --set checkpoint.final=false --set output_dir=train_cp_ring)
keel_cli_test(NAME train_cp_mode_typo EXIT 1 MATCH "parallel\\.context_mode.*must be allgather, ring, alltoall or auto"
  ARGS train ${tcfg} ${tdp} --set parallel.context_mode=rnig)
# auto: the tiny MoE's softmax layers under context parallelism alone take the ring, and the line says why.
keel_cli_test(NAME train_cp2_auto NP 2 MATCH "on cpu x context parallel 2 \\(zigzag, k/v ring. context_mode auto\\) "
  ARGS train ${tcfg} ${tshort} --set device=cpu --set parallel.context=2 --set parallel.context_mode=auto
       --set checkpoint.final=false --set output_dir=train_cp_auto)
set_tests_properties(cli_train_cp2_auto PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# By heads (parallel.context_mode: alltoall) on 2 CPU ranks and on 2 GPUs: trains and says so.
keel_cli_test(NAME train_cp2_alltoall NP 2 MATCH "on cpu x context parallel 2 \\(zigzag, heads by all-to-all\\) \\(ZeRO-1\\), "
  ARGS train ${tcfg} ${tshort} --set device=cpu --set parallel.context=2 --set parallel.context_mode=alltoall
       --set checkpoint.final=false --set output_dir=train_cp_alltoall)
set_tests_properties(cli_train_cp2_alltoall PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_cp2_alltoall_gpus NP 2 GPUS "2+"
  MATCH "context parallel 2 \\(zigzag, heads by all-to-all\\)"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.context=2 --set parallel.context_mode=alltoall
       --set checkpoint.final=false --set output_dir=train_cp_alltoall_gpu)
set_tests_properties(cli_train_cp2_alltoall_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# TSP (parallel.tsp) on 2 CPU ranks trains and says so; a bad degree is one line; on GPUs
# (skipped elsewhere) it is refused with one line.
keel_cli_test(NAME train_tsp2 NP 2
  MATCH "x TSP 2 \\(attention shards broadcast, MLP shards ringed, (tokens gathered for the vocabulary tables|vocabulary tables swept), tokens zigzag. tsp_tables auto\\)"
  ARGS train ${tcfg} ${tdp} --set parallel.tsp=2 --set checkpoint.final=false --set output_dir=train_tsp2)
keel_cli_test(NAME train_tsp2_gather NP 2
  MATCH "x TSP 2 \\(attention shards broadcast, MLP shards ringed, tokens gathered for the vocabulary tables, tokens zigzag\\)"
  ARGS train ${tcfg} ${tdp} --set parallel.tsp=2 --set parallel.tsp_tables=gather --set checkpoint.final=false
       --set output_dir=train_tsp2_gather)
keel_cli_test(NAME train_tsp2_ring NP 2 MATCH "x TSP 2 \\(attention shards broadcast, .*tokens zigzag. k/v ring"
  ARGS train ${tcfg} ${tdp} --set parallel.tsp=2 --set parallel.context_mode=ring --set checkpoint.final=false
       --set output_dir=train_tsp2_ring)
keel_cli_test(NAME train_tsp_bad_degree EXIT 1 MATCH "parallel\\.tsp.*must be >= 1"
  ARGS train ${tcfg} ${tdp} --set parallel.tsp=0)
keel_cli_test(NAME train_tsp_bad_tables EXIT 1 MATCH "parallel\\.tsp_tables.*must be auto, sweep or gather"
  ARGS train ${tcfg} ${tdp} --set parallel.tsp=2 --set parallel.tsp_tables=sideways)
keel_cli_test(NAME train_tsp_tables_without_tsp EXIT 1 MATCH "parallel\\.tsp_tables.*needs parallel\\.tsp above 1"
  ARGS train ${tcfg} ${tdp} --set parallel.tsp_tables=gather)
# TSP on 2 GPUs (skipped elsewhere): it trains and says so.
keel_cli_test(NAME train_tsp2_gpus NP 2 GPUS "2+" MATCH "TSP 2 \\(attention shards broadcast, MLP shards ringed"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.tsp=2 --set checkpoint.final=false
       --set output_dir=train_tsp2_gpu)
set_tests_properties(cli_train_tsp2 cli_train_tsp2_gather cli_train_tsp2_ring cli_train_tsp2_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# The k/v ring on 2 GPUs: trains and says so.
keel_cli_test(NAME train_cp2_ring_gpus NP 2 GPUS "2+"
  MATCH "on .* x context parallel 2 \\(zigzag, k/v ring\\)"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.context=2 --set parallel.context_mode=ring
       --set checkpoint.final=false --set output_dir=train_cp_ring_gpu)
set_tests_properties(cli_train_cp2_ring cli_train_cp2_ring_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_cp2_gpus NP 2 GPUS "2+" MATCH "context parallel 2 \\(zigzag\\)"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.context=2 --set checkpoint.final=false
       --set output_dir=train_cp_gpu)
set_tests_properties(cli_train_cp2_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_lasp2_cp2_gpus NP 2 GPUS "2+" MATCH "context parallel 2 \\(zigzag. LASP-2H"
  ARGS train ${tcfg} ${tshort} ${tlasp} --set device=cuda --set parallel.context=2 --set checkpoint.final=false
       --set output_dir=train_lasp_gpu)
set_tests_properties(cli_train_lasp2_cp2_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_sequence_without_tensor EXIT 1
  MATCH "parallel\\.sequence.*needs parallel\\.tensor above 1"
  ARGS train ${tcfg} ${tdp} --set parallel.sequence=true)
# Tensor parallelism on 2 GPUs (skipped elsewhere): with sequence parallelism, and with Muon
# (whole matrices orthogonalized on their owners), it trains and says so.
keel_cli_test(NAME train_tp2_gpus NP 2 GPUS "2+" MATCH "tensor parallel 2 \\(sequence parallel\\)"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.tensor=2 --set parallel.sequence=true
       --set checkpoint.final=false --set output_dir=train_tp_gpu)
set_tests_properties(cli_train_tp2_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_tp2_gpus_muon NP 2 GPUS "2+" MATCH "tensor parallel 2"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.tensor=2 --set optimizer.muon.enabled=true
       --set checkpoint.final=false --set output_dir=train_tp_gpu_muon)
set_tests_properties(cli_train_tp2_gpus_muon PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# Tensor parallelism and TSP with data parallelism, and tensor with context parallelism, on 4
# GPUs (skipped elsewhere): ZeRO-1's classic step over the data axis, and they say so.
keel_cli_test(NAME train_tp2_dp2_gpus NP 4 GPUS "4+" MATCH "2 data-parallel ranks.*tensor parallel 2 \\(sequence parallel\\)"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.tensor=2 --set parallel.sequence=true
       --set optimizer.muon.enabled=true --set batch.grad_accum=2 --set checkpoint.final=false
       --set output_dir=train_tp_dp_gpu)
keel_cli_test(NAME train_tsp2_dp2_gpus NP 4 GPUS "4+" MATCH "2 data-parallel ranks.*TSP 2"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.tsp=2 --set batch.grad_accum=2
       --set checkpoint.final=false --set output_dir=train_tsp_dp_gpu)
keel_cli_test(NAME train_cp2_tp2_gpus NP 4 GPUS "4+" MATCH "context parallel 2 \\(zigzag\\).*tensor parallel 2"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.context=2 --set parallel.tensor=2
       --set parallel.sequence=true --set checkpoint.final=false --set output_dir=train_cp_tp_gpu)
set_tests_properties(cli_train_tp2_dp2_gpus cli_train_tsp2_dp2_gpus cli_train_cp2_tp2_gpus PROPERTIES
  FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# Expert parallelism in the classic ZeRO-1 step on 2 GPUs (skipped elsewhere): the expert region
# reduce-scattered over the expert-data group (here one rank: each GPU holds its experts whole).
keel_cli_test(NAME train_ep_classic_step_gpus NP 2 GPUS "2+" MATCH "done: steps 0 -> 16"
  NOT "overlapped ZeRO-1 step"
  ARGS train ${tcfg} ${tshort} --set device=cuda --set parallel.expert=2 --set parallel.zero1.overlap=false
       --set batch.grad_accum=2 --set checkpoint.final=false --set output_dir=train_ep_classic_gpu)
set_tests_properties(cli_train_ep_classic_step_gpus PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_dp_degree_mismatch NP 2 EXIT 1
  MATCH "parallel\\.data \\(3\\) x parallel\\.context \\(1\\) x parallel\\.tensor \\(1\\) must equal the number of ranks \\(2\\)"
  ARGS train ${tcfg} ${tdp} --set parallel.data=3)
keel_cli_test(NAME train_dp_batch_does_not_split NP 2 EXIT 1 MATCH "batch\\.grad_accum \\(3\\) must be a multiple of the data-parallel degree \\(2\\)"
  ARGS train ${tcfg} ${tdp} --set batch.grad_accum=3)
set_tests_properties(cli_train_dp_batch_does_not_split PROPERTIES FIXTURES_REQUIRED train_stories)
keel_cli_test(NAME train_expert_parallel_does_not_divide NP 2 EXIT 1
  MATCH "parallel\\.expert \\(3\\) must divide the data x context ranks \\(2\\) and the experts \\(4\\)"
  ARGS train ${tcfg} ${tdp} --set parallel.expert=3)
# A rank that hangs (fault injection: rank 1 sleeps at the start of step 3) leaves rank 0 inside
# a collective: both exit within --timeout with one line naming the step, never a hang, and the
# stuck rank says it is the one (rank 0, waiting, gives it a grace period to say so).
# device: auto under mpiexec: the ranks agree on CPU or GPU before any of them starts. Which
# outcome is right depends on the GPUs keel sees (GPUS: the others skip): none (CI, or a build
# without CUDA), both train on CPU; 2 or more, each rank binds its own; one, the 2 ranks would
# share it, which is refused with one line.
keel_cli_test(NAME train_dp_device_auto NP 2 GPUS "0,2+" MATCH "done: steps 0 -> 16"
  ARGS train ${tcfg} ${tshort} --set device=auto --set batch.grad_accum=2 --set output_dir=train_dp_auto)
set_tests_properties(cli_train_dp_device_auto PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_dp_device_auto_one_gpu NP 2 GPUS 1 EXIT 1
  MATCH "keel: error: .*node-local ranks 0 and 1 on host .* would drive the same GPU .*launch one rank per GPU"
  NOT "done: steps"
  ARGS train ${tcfg} ${tshort} --set device=auto --set batch.grad_accum=2 --set output_dir=train_dp_auto1)
set_tests_properties(cli_train_dp_device_auto_one_gpu PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
# parallel.grad_reduce: bf16 (gradients summed in bf16 over the ranks) is taken and said.
# Device auto too: 2 CPU ranks, or a GPU each (one GPU for 2 ranks is refused, above).
keel_cli_test(NAME train_dp_bf16_grad_reduce NP 2 GPUS "0,2+" MATCH "x 2 data-parallel ranks \\(ZeRO-1, gradients reduced in bf16\\)"
  ARGS train ${tcfg} ${tshort} --set parallel.grad_reduce=bf16 --set steps=4 --set batch.grad_accum=2
       --set checkpoint.final=false --set output_dir=train_dp_bf16)
set_tests_properties(cli_train_dp_bf16_grad_reduce PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_hung_rank_is_an_error NP 2 EXIT nonzero
  MATCH "keel: error: \\[rank 1\\] step 3 did not finish within 5 s \\(--timeout\\): this rank is the stuck one \\(it was not waiting on another rank\\)"
  NOT "\\[rank 0\\] .*stuck one"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_hang --set checkpoint.final=false --timeout 5
       --inject-hang-rank 1 --inject-hang-step 3)
set_tests_properties(cli_train_hung_rank_is_an_error PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean" TIMEOUT 60
                     RUN_SERIAL TRUE)  # as the bench comm hang tests: wall-clock timeouts
# A checkpoint commits once every rank's writes are done, not at the next save: the run below
# saves at step 20 and hangs at step 30 (no destructor runs after the watchdog fires), and step
# 20 is committed and `latest` (before, the hang lost it: nothing was committed).
keel_cli_test(NAME train_hang_after_save NP 2 EXIT nonzero MATCH "step 30 did not finish within 5 s"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_hang_ck --set steps=40 --set checkpoint.interval=20
       --set checkpoint.final=false --timeout 5 --inject-hang-rank 1 --inject-hang-step 30)
set_tests_properties(cli_train_hang_after_save PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean"
                     FIXTURES_SETUP train_hang_ck TIMEOUT 90)
keel_cli_test(NAME train_hang_after_save_committed MATCH "step_00000020  committed  <- latest"
  ARGS ckpt inspect train_hang_ck)
set_tests_properties(cli_train_hang_after_save_committed PROPERTIES FIXTURES_REQUIRED train_hang_ck)
# Start-up waits on every rank too (the config comparison, which ranks see a GPU): a rank that
# never gets there is named, not a hang of the others.
keel_cli_test(NAME train_hung_at_start_is_named NP 2 EXIT nonzero
  MATCH "keel: error: \\[rank 1\\] start-up \\(config check, GPU binding\\) did not finish within 5 s \\(--timeout\\): this rank is the stuck one"
  NOT "\\[rank 0\\] .*stuck one"
  ARGS train ${tcfg} ${tdp} --set output_dir=train_hang_start --timeout 5 --inject-hang-rank 1 --inject-hang-step 0)
set_tests_properties(cli_train_hung_at_start_is_named PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean"
                     TIMEOUT 60)
keel_cli_test(NAME train_inject_hang_step_negative EXIT 1 MATCH "--inject-hang-step must be >= 0 \\(0: at start-up\\)"
  ARGS train ${tcfg} --inject-hang-rank 0 --inject-hang-step -2)
keel_cli_test(NAME train_inject_hang_needs_both EXIT 1 MATCH "--inject-hang-rank and --inject-hang-step go together"
  ARGS train ${tcfg} --inject-hang-rank 0)

# The hooks of a supervisor (docs/train.md "Fault injection, heartbeats, skipped data"): --inject
# kills, exits, slows or NaNs a rank at a step, one line each; a malformed spec is one line naming it.
set(tfault ${tshort} --set device=cpu --set checkpoint.final=false --set log_interval=1)
keel_cli_test(NAME train_inject_unknown EXIT 1
  MATCH "^keel: error: --inject kil@3: unknown fault 'kil' \\(kill, exit, hang, slow, nan, spike, diskfull, slowsave, health, slowgpu\\)$"
  ARGS train ${tcfg} ${tfault} --set output_dir=train_never --inject kill@5 --inject kil@3)
keel_cli_test(NAME train_heartbeat_udp_malformed EXIT 1
  MATCH "^keel: error: --heartbeat-udp node7/2: expected HOST:PORT$"
  ARGS train ${tcfg} ${tfault} --set output_dir=train_never --heartbeat-udp node7/2)
keel_cli_test(NAME train_heartbeat_udp_unresolved EXIT 1
  MATCH "^keel: error: --heartbeat-udp no-such-host.invalid:9/1: cannot resolve no-such-host.invalid:9: "
  ARGS train ${tcfg} ${tfault} --set output_dir=train_never --heartbeat-udp no-such-host.invalid:9/1)
keel_cli_test(NAME train_inject_rank_outside EXIT 1
  MATCH "^keel: error: --inject exit@2:r1: rank 1 is not in this run of 1 rank \\(0-0\\)$"
  ARGS train ${tcfg} ${tfault} --set output_dir=train_never --inject exit@2:r1)
keel_cli_test(NAME train_inject_exit EXIT 3 MATCH "keel: fault injection: rank 0 exits with code 3 at step 3"
  NOT "step +3/16"
  ARGS train ${tcfg} ${tfault} --set output_dir=train_inject_exit --inject exit@3)
keel_cli_test(NAME train_inject_kill EXIT 137 MATCH "keel: fault injection: rank 0 killed at step 2"
  NOT "step +2/16"
  ARGS train ${tcfg} ${tfault} --set output_dir=train_inject_kill --inject kill@2)
keel_cli_test(NAME train_inject_nan EXIT nonzero
  MATCH "keel: error: step 2: loss is NaN \\(ce NaN, aux NaN, z NaN\\): stopping"
  ARGS train ${tcfg} ${tfault} --set output_dir=train_inject_nan --inject nan@2)
# On one rank of 2, data parallel and tensor parallel: every rank stops at that step, none hangs.
keel_cli_test(NAME train_inject_nan_dp NP 2 EXIT nonzero MATCH "step 3: loss is NaN" NOT "did not finish within"
  ARGS train ${tcfg} ${tfault} --set batch.grad_accum=2 --set output_dir=train_inject_nan_dp --timeout 60
       --inject nan@3:r1)
keel_cli_test(NAME train_inject_nan_tp NP 2 EXIT nonzero MATCH "step 3: loss is NaN" NOT "did not finish within"
  ARGS train ${tcfg} ${tfault} --set parallel.tensor=2 --set output_dir=train_inject_nan_tp --timeout 60
       --inject nan@3:r1)
keel_cli_test(NAME train_inject_slow MATCH "keel: fault injection: rank 0 sleeps 200 ms at step 3"
  NOT "sleeps 200 ms at step 4"
  ARGS train ${tcfg} ${tfault} --set steps=4 --set output_dir=train_inject_slow --inject slow@2-3:200)
set_tests_properties(cli_train_inject_rank_outside PROPERTIES FIXTURES_REQUIRED train_stories)
set_tests_properties(cli_train_inject_exit cli_train_inject_kill cli_train_inject_nan cli_train_inject_nan_dp
                     cli_train_inject_nan_tp cli_train_inject_slow
                     PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_skip_step_zero EXIT 1 MATCH "^keel: error: --skip-step 0: must be a step >= 1"
  ARGS train ${tcfg} --skip-step 0)
# --heartbeat DIR: each rank's DIR/rank-<r>.json after start-up, every step and the end (one and
# two ranks); --skip-step S: step S trains on the data after its own, and a resumed run applies
# the skip only where its checkpoint predates it (tests/train/check_train_faults.py).
add_test(NAME train_heartbeat
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/train/check_train_faults.py heartbeat $<TARGET_FILE:keel>
                 train_stories train_faults_hb
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
add_test(NAME train_heartbeat_mpi
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/train/check_train_faults.py heartbeat $<TARGET_FILE:keel>
                 train_stories train_faults_hb_mpi ${KEEL_MPIEXEC} -n 2
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
add_test(NAME train_skip_step
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/train/check_train_faults.py skip $<TARGET_FILE:keel>
                 train_stories train_faults_skip
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(train_heartbeat train_heartbeat_mpi train_skip_step PROPERTIES FIXTURES_REQUIRED train_stories
                     ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 300)

# Bad input.
keel_cli_test(NAME train_unknown_key EXIT 1 MATCH "^keel: error: .*tiny\\.yaml: unknown key 'optimizer\\.lrr' \\(from --set\\)"
  ARGS train ${tcfg} --set optimizer.lrr=1)
keel_cli_test(NAME train_missing_config EXIT 1 MATCH "^keel: error: .*nope\\.yaml"
  ARGS train nope.yaml)
keel_cli_test(NAME train_missing_dataset EXIT 1 MATCH "^keel: error: .*no_such_prefix"
  ARGS train ${tcfg} --set data.datasets.stories=no_such_prefix)
keel_cli_test(NAME train_linear_feature_typo EXIT 1
  MATCH "^keel: error: .*key 'linear_feature': unknown feature map 'relu' \\(choose identity or elu1\\)"
  ARGS train ${tcfg} --set model.attention=linear --set model.linear_feature=relu)

# ZAYA1 (CCA, MLP router with EDA and the skip class, residual scaling) on the CPU: a few steps
# of the tiny config (docs/train.md).
keel_cli_test(NAME train_zaya1_tiny MATCH "done: steps 0 -> 4 in .* s, loss 5\\.[0-9]+ -> "
  ARGS train ${PROJECT_SOURCE_DIR}/configs/train/zaya1-tiny.yaml --set data.datasets.stories=train_stories
       --set steps=4 --set log_interval=2 --set schedule.warmup_steps=2 --set data.seq_length=64
       --set batch.micro_batch=2 --set eval.prefix=train_stories_heldout --set eval.interval=4
       --set output_dir=train_zaya)
set_tests_properties(cli_train_zaya1_tiny PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")

# The real tensorboard Python package reads the event file keel's MetricsLog writes
# (src/train/tb_writer.*, docs/train_logging.md); fails, not skips, without the package.
add_test(NAME train_tensorboard_reads_keel_events
         COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/train/check_tensorboard.sh $<TARGET_FILE:keel_tests>)
set_tests_properties(train_tensorboard_reads_keel_events PROPERTIES TIMEOUT 120)

# Routing health on real text (issue 36, part 4): keel train's defaults for ZAYA1's router keep
# every MoE layer of the tiny ZAYA1 under 2x its fair share at every step after step 50, where
# the previous controller (sign 0.01, full router lr) goes over and the old init (router.init_gain
# 0) collapses onto one class; three runs, 100 CPU steps each (about 60 s).
add_test(NAME train_routing_health
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/train/check_routing.py $<TARGET_FILE:keel> train_stories train_routing
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(train_routing_health PROPERTIES FIXTURES_REQUIRED train_stories ENVIRONMENT "CUDA_VISIBLE_DEVICES=" TIMEOUT 600)

# kernels.profile: the step's phases on the GPU (the table after the closing line), a clear
# refusal on the CPU.
keel_cli_test(NAME train_profile_cpu EXIT 1
  MATCH "^keel: error: kernels.profile: times the GPU step phase by phase \\(CUDA events\\). this run is on cpu$"
  ARGS train ${tcfg} ${tshort} --set steps=4 --set device=cpu --set output_dir=train_profile_cpu --set kernels.profile=true)
set_tests_properties(cli_train_profile_cpu PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
keel_cli_test(NAME train_profile_gpu GPUS 1+
  MATCH "step profile \\(kernels.profile: CUDA events on the compute stream. mean over 4 steps after 2 warm-up\\)"
  ARGS train ${tcfg} ${tshort} --set steps=6 --set device=cuda --set output_dir=train_profile_gpu --set kernels.profile=true
       --set checkpoint.final=false)
set_tests_properties(cli_train_profile_gpu PROPERTIES FIXTURES_REQUIRED "train_stories;train_outputs_clean")
