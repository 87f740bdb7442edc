# `keel bench comm` as a user runs it, on CPU ranks under mpiexec (see tests/CMakeLists.txt).
set(quick --backend mpi --min 96 --max 6K --factor 4 -w 1 -n 3)

keel_cli_test(NAME comm_all_ops_np2 NP 2 MATCH "Wrong values: 0 OK"
  ARGS bench comm ${quick} --op all --dtype bf16,fp16,fp32 --redop sum,avg)
keel_cli_test(NAME comm_all_ops_np3 NP 3 MATCH "Wrong values: 0 OK"
  ARGS bench comm ${quick} --op all --dtype bf16 --ranks 2,3)
keel_cli_test(NAME comm_all_groups NP 4 MATCH "2 groups at once"
  ARGS bench comm ${quick} --op all_reduce,all_to_all --ranks 2 --all-groups)
# A world of one measures nothing a collective does (busbw 0, or a local copy): refused.
keel_cli_test(NAME comm_no_launcher EXIT 1 MATCH "keel: error: collectives need at least 2 ranks, but the world has 1"
  ARGS bench comm ${quick})
keel_cli_test(NAME comm_single_rank_group NP 2 EXIT nonzero MATCH "collectives need at least 2 ranks, got --ranks 1"
  ARGS bench comm ${quick} --ranks 1 --min-busbw 0.001)
# A non-integer factor: sizes between --min and --max round down to whole elements (486 B -> 484 B).
keel_cli_test(NAME comm_fractional_factor NP 2 MATCH " 484 +121 "
  ARGS bench comm --backend mpi --min 64 --max 1K --factor 1.5 -w 1 -n 2)
# No deadline: a huge --timeout once overflowed into a deadline in the past (a false hang).
keel_cli_test(NAME comm_infinite_timeout NP 2 MATCH "Wrong values: 0 OK" ARGS bench comm ${quick} --timeout inf)
keel_cli_test(NAME comm_huge_timeout NP 2 MATCH "Wrong values: 0 OK" ARGS bench comm ${quick} --timeout 1e300)
# --timeout as every keel command takes it (common/watchdog.h): 0 is no deadline too (it was an
# error here, and meant "wait forever" in keel train), a negative value one line.
keel_cli_test(NAME comm_zero_timeout NP 2 MATCH "Wrong values: 0 OK" ARGS bench comm ${quick} --timeout 0)
keel_cli_test(NAME comm_negative_timeout EXIT 1
  MATCH "^keel: error: --timeout -1: must be seconds >= 0 \\(0 or inf: no deadline\\)$" ARGS bench comm ${quick} --timeout -1)
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
keel_cli_test(NAME comm_in_place_all_to_all NP 2 EXIT nonzero MATCH "all_to_all has no in-place form"
  ARGS bench comm --backend mpi --op all_to_all --placement in)
keel_cli_test(NAME comm_graph_needs_nccl EXIT nonzero MATCH "--graph needs the nccl backend" ARGS bench comm --backend mpi -G 5)
keel_cli_test(NAME comm_unknown_dtype EXIT nonzero MATCH "unknown dtype 'int3'" ARGS bench comm --backend mpi --dtype int3)
keel_cli_test(NAME comm_unknown_flag EXIT nonzero MATCH "--frobnicate" ARGS bench comm --frobnicate)
# Sizes beyond 1 PiB once overflowed the size sweep into an endless loop, past --timeout.
keel_cli_test(NAME comm_huge_max NP 2 EXIT nonzero MATCH "keel: error: .*--max 16000000 TiB is too large"
  ARGS bench comm --backend mpi -b 8 -e 16000000T --timeout 5)
set_tests_properties(cli_comm_huge_max PROPERTIES TIMEOUT 60)
keel_cli_test(NAME comm_infinite_factor EXIT 1 MATCH "--factor must be a finite number greater than 1, got inf"
  ARGS bench comm --backend mpi -f inf)
keel_cli_test(NAME comm_nan_gate NP 2 EXIT nonzero MATCH "--min-busbw must be a finite number of GB/s, 0 or more, got nan"
  ARGS bench comm ${quick} --min-busbw nan)
# Output paths are checked before the sweep, on every rank's behalf (no rank may hang).
keel_cli_test(NAME comm_json_dir_missing NP 2 EXIT nonzero MATCH "--json '/nonexistent_keel_dir/r.json': directory"
  NOT "Wrong values" ARGS bench comm ${quick} --json /nonexistent_keel_dir/r.json)
keel_cli_test(NAME comm_csv_unwritable NP 2 EXIT nonzero MATCH "--csv '/proc/keel_r.csv' cannot be written"
  NOT "Wrong values" ARGS bench comm ${quick} --csv /proc/keel_r.csv)
keel_cli_test(NAME comm_plot_is_directory NP 2 EXIT nonzero MATCH "--plot '.' is a directory"
  NOT "Wrong values" ARGS bench comm ${quick} --plot .)
keel_cli_test(NAME comm_same_output_twice NP 2 EXIT nonzero MATCH "--json and --csv both name 'comm_same.json'"
  NOT "Wrong values" ARGS bench comm ${quick} --json comm_same.json --csv comm_same.json)

# Memory is checked before any buffer is allocated (issue 34: `-b 8G -e 8G` on CPU ranks was
# killed by the OOM killer after 44 s, exit 137, no keel line). A size no machine holds, so the
# check refuses it everywhere, with one line from rank 0 (before: each rank's allocation failed
# alone, "cannot allocate ... bytes", or the pages were filled until the kernel killed it).
keel_cli_test(NAME comm_host_memory_checked_first NP 2 EXIT 1
  MATCH "^keel: error: (\\[rank 0\\] )?bench comm: the sweep needs 384 TiB of host memory on .*: 2 ranks x \\(64 TiB send \\+ 64 TiB receive buffers \\+ up to 64 TiB of MPI reduction scratch\\), but only .* is available: lower --max \\(-e\\) or start fewer ranks on this host$"
  NOT "\\[rank 1\\]|cannot allocate|Wrong values"
  ARGS bench comm --backend mpi -b 64T -e 64T --op all_reduce)
set_tests_properties(cli_comm_host_memory_checked_first PROPERTIES TIMEOUT 60)
if(KEEL_HAVE_CUDA)
  # The same on GPUs (device memory, every GPU driven from one process): needs 2 GPUs to run a
  # collective at all (GPUS: skipped elsewhere).
  keel_cli_test(NAME comm_device_memory_checked_first GPUS 2+ EXIT 1
    MATCH "^keel: error: bench comm: the sweep needs 128 TiB on GPU 0 of .* \\(64 TiB send \\+ 64 TiB receive buffers\\), but .* is free: lower --max \\(-e\\)$"
    NOT "cannot allocate|Wrong values"
    ARGS bench comm --backend nccl -b 64T -e 64T --op all_reduce)
  set_tests_properties(cli_comm_device_memory_checked_first PROPERTIES TIMEOUT 60)
endif()

# Faults: a hung rank trips --timeout; a corrupted result fails the check; a slow link fails the gate.
# The hung rank names itself; the ranks waiting on it in a collective never claim to be stuck.
keel_cli_test(NAME comm_hang_detected NP 2 EXIT nonzero
  MATCH "\\[rank 1\\] .*did not finish within 2 s \\(--timeout\\): this rank is the stuck one"
  NOT "\\[rank 0\\] .*stuck one" ARGS bench comm ${quick} --timeout 2 --inject-hang 1)
keel_cli_test(NAME comm_hang_named_among_three NP 3 EXIT nonzero
  MATCH "\\[rank 1\\] .*did not finish within 3 s \\(--timeout\\): this rank is the stuck one"
  NOT "\\[rank [02]\\] .*stuck one" ARGS bench comm ${quick} --op all_reduce,all_to_all --timeout 3 --inject-hang 1)
# Start-up waits too (the output check's broadcast, the communicators' bootstrap): a rank that
# never gets there is a timeout naming it, not a hang of the others.
keel_cli_test(NAME comm_hang_at_start_named NP 3 EXIT nonzero
  MATCH "\\[rank 1\\] starting up .*did not finish within 2 s \\(--timeout\\): this rank is the stuck one"
  NOT "\\[rank [02]\\] .*stuck one" ARGS bench comm ${quick} --timeout 2 --inject-hang 1 --inject-hang-at start)
keel_cli_test(NAME comm_inject_hang_at_unknown EXIT 1 MATCH "unknown --inject-hang-at 'middle' \\(case or start\\)"
  ARGS bench comm ${quick} --inject-hang-at middle)
# Serial: their seconds-long --timeout is wall time, and on a loaded many-core machine mpirun
# could interleave the ranks' lines (seen on 2 x H200 under ctest -j32; 6 of 6 pass alone).
set_tests_properties(cli_comm_hang_detected cli_comm_hang_named_among_three cli_comm_hang_at_start_named
                     PROPERTIES TIMEOUT 60 RUN_SERIAL TRUE)
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
