# `keel bench comm` as a user runs it, on CPU ranks under mpiexec (see tests/CMakeLists.txt).
set(quick --backend mpi --min 96 --max 6K --factor 4 -w 1 -n 3)

keel_cli_test(NAME comm_all_ops_np2 NP 2 MATCH "Wrong values: 0 OK"
  ARGS bench comm ${quick} --op all --dtype bf16,fp16,fp32 --redop sum,avg)
keel_cli_test(NAME comm_all_ops_np3 NP 3 MATCH "Wrong values: 0 OK"
  ARGS bench comm ${quick} --op all --dtype bf16 --ranks 1,2,3)
keel_cli_test(NAME comm_all_groups NP 4 MATCH "2 groups at once"
  ARGS bench comm ${quick} --op all_reduce,all_to_all --ranks 2 --all-groups)
keel_cli_test(NAME comm_no_launcher MATCH "world 1 ranks"
  ARGS bench comm ${quick})
add_test(NAME cli_comm_outputs_files
  COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/bench/comm/check_outputs.sh $<TARGET_FILE:keel> ${MPIEXEC_EXECUTABLE})
set_tests_properties(cli_comm_outputs_files PROPERTIES ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 300)

# Bad input: one clear line, non-zero exit.
keel_cli_test(NAME comm_unknown_op EXIT nonzero MATCH "keel: error: unknown op 'bogus'" ARGS bench comm --backend mpi --op bogus)
keel_cli_test(NAME comm_min_above_max EXIT nonzero MATCH "--min \\(1 MiB\\) is larger than --max" ARGS bench comm --backend mpi --min 1M --max 1K)
keel_cli_test(NAME comm_bad_size EXIT nonzero MATCH "--max '12X' has an unknown unit" ARGS bench comm --backend mpi --max 12X)
keel_cli_test(NAME comm_too_many_ranks NP 2 EXIT nonzero MATCH "--ranks 8 needs 8 ranks but only 2 are available"
  NOT "rank 1" ARGS bench comm --backend mpi --ranks 2,8)
keel_cli_test(NAME comm_indivisible NP 2 EXIT nonzero MATCH "does not split over 2 ranks of fp32 as all_gather needs"
  ARGS bench comm --backend mpi --op all_gather --min 4 --max 4)
keel_cli_test(NAME comm_in_place_all_to_all EXIT nonzero MATCH "all_to_all has no in-place form"
  ARGS bench comm --backend mpi --op all_to_all --placement in)
keel_cli_test(NAME comm_graph_needs_nccl EXIT nonzero MATCH "--graph needs the nccl backend" ARGS bench comm --backend mpi -G 5)
keel_cli_test(NAME comm_unknown_dtype EXIT nonzero MATCH "unknown dtype 'int3'" ARGS bench comm --backend mpi --dtype int3)
keel_cli_test(NAME comm_unknown_flag EXIT nonzero MATCH "--frobnicate" ARGS bench comm --frobnicate)

# Faults: a hung rank trips --timeout; a corrupted result fails the check; a slow link fails the gate.
keel_cli_test(NAME comm_hang_detected NP 2 EXIT nonzero MATCH "did not finish within 2 s \\(--timeout\\)"
  ARGS bench comm ${quick} --timeout 2 --inject-hang 1)
keel_cli_test(NAME comm_corruption_detected NP 2 EXIT 2 MATCH "wrong values, first at rank 1 element"
  ARGS bench comm ${quick} --op all_reduce,broadcast --inject-corrupt 1)
# One rank failing alone stops the whole job at once, not after the others' --timeout.
keel_cli_test(NAME comm_failing_rank_stops_job NP 3 EXIT nonzero MATCH "\\[rank 1\\] injected failure on rank 1"
  ARGS bench comm ${quick} --timeout 120 --inject-error 1)
set_tests_properties(cli_comm_failing_rank_stops_job PROPERTIES TIMEOUT 60)
keel_cli_test(NAME comm_busbw_gate NP 2 EXIT 3 MATCH "is below --min-busbw 1e\\+06"
  ARGS bench comm ${quick} --min-busbw 1e6)
keel_cli_test(NAME comm_busbw_gate_passes NP 2 EXIT 0 MATCH "Wrong values: 0 OK"
  ARGS bench comm ${quick} --min-busbw 0.000001)
if(KEEL_HAVE_CUDA)
  # Built with CUDA but run where there is no GPU (CI): a clear error, not a crash.
  keel_cli_test(NAME comm_nccl_without_gpu EXIT nonzero MATCH "no CUDA device is visible"
    ARGS bench comm --backend nccl)
  # Hide the GPUs of a GPU machine so the test means the same everywhere.
  set_tests_properties(cli_comm_nccl_without_gpu PROPERTIES ENVIRONMENT "${KEEL_MPI_ENV};CUDA_VISIBLE_DEVICES=")
endif()
