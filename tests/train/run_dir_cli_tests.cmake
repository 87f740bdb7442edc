# keel train's run directory under concurrency, signals and crashes (issue 34): real processes,
# tests/train/run_dir.sh (docs/train.md "One run per directory", "Stopping on a signal").
foreach(case lock signal signal-mpi second-signal restart)
  add_test(NAME cli_train_run_dir_${case}
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/train/run_dir.sh ${case} $<TARGET_FILE:keel> ${MPIEXEC_EXECUTABLE}
                   ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml ${CMAKE_CURRENT_BINARY_DIR}/train_stories
           WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  set_tests_properties(cli_train_run_dir_${case} PROPERTIES ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 120
                       FIXTURES_REQUIRED train_stories)
endforeach()
# A micro-batch no machine holds, with an eval set: the memory error comes at once, not after
# scanning eval.batches x micro_batch eval samples (about 6 minutes for 10^9 before).
keel_cli_test(NAME train_huge_micro_batch_with_eval EXIT 1
  MATCH "^keel: error: arena 'activations': needs [0-9.]+ TiB but this machine has"
  ARGS train ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml --set data.datasets.stories=train_stories
       --set eval.prefix=train_stories_heldout --set batch.micro_batch=1000000000 --set device=cpu --set output_dir=train_huge_batch)
set_tests_properties(cli_train_huge_micro_batch_with_eval PROPERTIES FIXTURES_REQUIRED train_stories TIMEOUT 30)
