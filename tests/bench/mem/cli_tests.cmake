# `keel bench mem` as a user runs it, on the CPU backend (see tests/CMakeLists.txt).
set(memq --backend cpu --threads 2 -w 1 -n 3)
set(memsizes -b 4K -e 256K -f 8)

keel_cli_test(NAME mem_cpu_all_kernels MATCH "Wrong values: 0 OK"
  ARGS bench mem ${memq} ${memsizes})
keel_cli_test(NAME mem_cpu_fp64_says_how_it_counts MATCH "bytes read \\+ bytes written\\) / best time"
  ARGS bench mem ${memq} ${memsizes} --dtype fp64 --op triad,dot)
keel_cli_test(NAME mem_cpu_peak_override MATCH "peak 100 GB/s"
  ARGS bench mem ${memq} ${memsizes} --op copy --peak-gbps 100)
add_test(NAME cli_mem_outputs_files COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/bench/mem/check_outputs.sh $<TARGET_FILE:keel>)
set_tests_properties(cli_mem_outputs_files PROPERTIES TIMEOUT 300)

# The checker is live: a damaged element fails the run with exit 2.
keel_cli_test(NAME mem_corruption_detected EXIT 2 MATCH "triad fp32 at 4 KiB: 1 wrong values, first: element 512"
  ARGS bench mem ${memq} --op triad -b 4K -e 4K --inject-corrupt)
keel_cli_test(NAME mem_dot_corruption_detected EXIT 2 MATCH "dot = .*expected"
  ARGS bench mem ${memq} --op dot -b 4K -e 4K --inject-corrupt)

# Bad input: one clear line, non-zero exit.
keel_cli_test(NAME mem_unknown_op EXIT nonzero MATCH "keel: error: unknown op 'bogus'" ARGS bench mem --backend cpu --op bogus)
keel_cli_test(NAME mem_unknown_dtype EXIT nonzero MATCH "unknown dtype 'bf8' for bench mem" ARGS bench mem --backend cpu --dtype bf8)
keel_cli_test(NAME mem_min_above_max EXIT nonzero MATCH "--min \\(1 MiB\\) is larger than --max \\(1 KiB\\)"
  ARGS bench mem --backend cpu -b 1M -e 1K)
keel_cli_test(NAME mem_transfer_needs_gpu EXIT nonzero MATCH "--op h2d_pinned needs a GPU"
  ARGS bench mem --backend cpu --op h2d_pinned)
keel_cli_test(NAME mem_out_of_memory EXIT nonzero MATCH "out of memory: copy of 1 TiB needs 3 TiB of host memory"
  ARGS bench mem --backend cpu --op copy -b 1T -e 1T)
keel_cli_test(NAME mem_bad_size EXIT nonzero MATCH "--max '12X' has an unknown unit" ARGS bench mem --backend cpu --max 12X)
keel_cli_test(NAME mem_zero_iters EXIT nonzero MATCH "--iters must be at least 1" ARGS bench mem --backend cpu -n 0)
if(KEEL_HAVE_CUDA)
  # Built with CUDA: without a GPU (CI) a clear error, not a crash; with one, a checked result.
  keel_cli_test(NAME mem_cuda_without_gpu EXIT any MATCH "no CUDA device is visible|Wrong values: 0 OK"
    ARGS bench mem --backend cuda --op copy -b 1M -e 1M -n 2)
endif()
# A group that leaves nothing to run on this backend is an error, not an empty run that exits 0.
keel_cli_test(NAME mem_peer_on_cpu EXIT 1
  MATCH "keel: error: --op peer_write, peer_read, peer_bidir_write, peer_bidir_read needs a GPU: --backend cuda. nothing to run on the cpu backend"
  ARGS bench mem --backend cpu --op peer -b 64K -e 64K)
keel_cli_test(NAME mem_transfers_on_cpu EXIT 1 MATCH "keel: error: --op h2d_pinned, .* nothing to run on the cpu backend"
  ARGS bench mem --backend cpu --op transfers -b 64K -e 64K)
# Thousands of threads only oversubscribe the cores (and ran for minutes): bounded.
keel_cli_test(NAME mem_too_many_threads EXIT 1 MATCH "keel: error: --threads 30000 is more than [0-9]+ \\(the larger of 64 and 4 x"
  ARGS bench mem --backend cpu --threads 30000)
