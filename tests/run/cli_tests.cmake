# `keel run`, the supervisor: bad flags are one line; the fault drills on 2 CPU ranks
# (tests/run/check_run.py: kill, hang, NaN, loss spike, disk full, give up, corrupt checkpoint,
# straggler (reported, and excluded), the pre-flight gate passing, excluding and stopping, SIGTERM;
# about 80 s).
set(rcfg ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml)
keel_cli_test(NAME run_bad_heartbeats EXIT 1 MATCH "^keel: error: --heartbeats: bogus not in \\{auto,files,udp,both\\}"
  ARGS run ${rcfg} --heartbeats bogus)
keel_cli_test(NAME run_bad_heartbeat_host EXIT 1
  MATCH "^keel: error: --heartbeat-host no-such-host.invalid: cannot resolve no-such-host.invalid:[0-9]+: "
  ARGS run ${rcfg} --heartbeats udp --heartbeat-host no-such-host.invalid)
keel_cli_test(NAME run_bad_max_restarts EXIT 1 MATCH "--max-restarts -1: must be >= 0"
  ARGS run ${rcfg} --max-restarts -1)
keel_cli_test(NAME run_bad_hang_factor EXIT 1 MATCH "--hang-factor 0.5: must be >= 1"
  ARGS run ${rcfg} --hang-factor 0.5)
keel_cli_test(NAME run_bad_straggler_factor EXIT 1 MATCH "--straggler-factor 1: must be above 1 \\(or 0: off\\)"
  ARGS run ${rcfg} --straggler-factor 1)
keel_cli_test(NAME run_bad_launcher EXIT 1 MATCH "^keel: error: --launcher slurm: must be mpirun or srun$"
  ARGS run ${rcfg} --launcher slurm)
keel_cli_test(NAME run_srun_takes_no_hosts EXIT 1
  MATCH "^keel: error: --hosts hosts.txt: srun runs on the Slurm allocation's nodes. --hosts is mpirun's$"
  ARGS run ${rcfg} --launcher srun --hosts hosts.txt)
keel_cli_test(NAME run_bad_hosts_file EXIT 1 MATCH "^keel: error: run: --hosts no_such_hosts.txt: cannot read the host file$"
  ARGS run ${rcfg} --set device=cpu --hosts no_such_hosts.txt)
keel_cli_test(NAME run_bad_inject EXIT 1 MATCH "--inject kil@3: unknown fault 'kil'"
  ARGS run ${rcfg} --inject kil@3)
keel_cli_test(NAME run_inside_a_launcher_is_refused NP 2 EXIT 1
  MATCH "keel run is the supervisor, not a rank" ARGS run ${rcfg})
# In a Slurm batch script (SLURM_NTASKS set, no step) keel run is no rank: its errors carry no
# rank prefix; inside an srun step of 2 tasks it refuses to run.
keel_cli_test(NAME run_in_a_batch_script EXIT 1 MATCH "^keel: error: --max-restarts -1: must be >= 0$"
  ARGS run ${rcfg} --max-restarts -1)
set_tests_properties(cli_run_in_a_batch_script PROPERTIES ENVIRONMENT "SLURM_NTASKS=4;SLURM_PROCID=0")
keel_cli_test(NAME run_in_an_srun_step_is_refused EXIT 1 MATCH "\\[rank 0\\] run: keel run is the supervisor, not a rank"
  ARGS run ${rcfg})
set_tests_properties(cli_run_in_an_srun_step_is_refused PROPERTIES ENVIRONMENT "SLURM_STEP_NUM_TASKS=2;SLURM_PROCID=0")
keel_cli_test(NAME run_bad_inject_spike EXIT 1 MATCH "--inject spike@3:0: '0' is not a loss factor \\(a number > 0\\)"
  ARGS run ${rcfg} --inject spike@3:0)
keel_cli_test(NAME run_bad_preflight_floor EXIT 1
  MATCH "^keel: error: --preflight-floor gemm=fast: 'fast' is not a number >= 0$"
  ARGS run ${rcfg} --preflight --preflight-floor gemm=fast)
keel_cli_test(NAME run_bad_preflight_fraction EXIT 1 MATCH "^keel: error: --preflight-fraction 1.5: must be in \\(0, 1.$"
  ARGS run ${rcfg} --preflight --preflight-fraction 1.5)
keel_cli_test(NAME run_bad_spike_window EXIT 1
  MATCH "^keel: error: .*tiny\\.yaml: key 'fault\\.loss_spike_window' \\(from --set\\): must be >= 5 \\(steps\\)$"
  ARGS run ${rcfg} --set fault.loss_spike_window=4)
# What keel run reads from keel train, on its own: the loss-spike guard's line (one rank, and
# two tensor-parallel ranks that stop alike, neither hanging), and a checkpoint write that finds
# the disk full (one line naming checkpoint.dir, ENOSPC and the `latest` that stays).
set(rshort --set data.datasets.stories=train_stories --set steps=12 --set log_interval=1 --set schedule.warmup_steps=4
    --set data.seq_length=64 --set batch.micro_batch=4 --set eval.prefix=train_stories_heldout --set eval.interval=0
    --set device=cpu --set checkpoint.final=false)
set(rspike --set fault.loss_spike_sigma=6 --set fault.loss_spike_window=5)
keel_cli_test(NAME run_train_loss_spike EXIT nonzero
  MATCH "^keel: error: step 8: loss [0-9.e+]+ is a spike \\(> mean [0-9.]+ \\+ 6 x std [0-9.e-]+ over the last 5 steps\\)$"
  NOT "^step +8/"
  ARGS train ${rcfg} ${rshort} ${rspike} --set output_dir=run_cli/spike --inject spike@8)
keel_cli_test(NAME run_train_loss_spike_tp NP 2 EXIT nonzero MATCH "step 8: loss [0-9.e+]+ is a spike"
  NOT "did not finish within"
  ARGS train ${rcfg} ${rshort} ${rspike} --set parallel.tensor=2 --set output_dir=run_cli/spike_tp --timeout 60
       --inject spike@8:r1)
keel_cli_test(NAME run_train_disk_full EXIT 1
  MATCH "^keel: error: checkpoint\\.dir run_cli/diskfull: save of step 4 failed on 1 rank\\(s\\), nothing committed, the previous checkpoint stays: rank 0: cannot write run_cli/diskfull/step_00000004/data_r00000_b0\\.bin: No space left on device. `latest` is step_00000002$"
  ARGS train ${rcfg} ${rshort} --set checkpoint.interval=2 --set output_dir=run_cli/diskfull --inject diskfull@4)
# A GPU straggler on a GPU machine (skipped elsewhere): rank 1's device canary made 8 times
# slower from step 10 (slowgpu: its loop runs 8 times as long) is named, with its kind, while the step
# times cannot tell the ranks apart; 2 ranks, NCCL staged through MPI where they share a GPU.
# Both ranks sleep 150 ms a step (so keel run, polling every 0.1 s, sees every heartbeat). The
# line names the rank's GPU (its heartbeat's: CUDA ordinal and PCI bus id).
keel_cli_test(NAME run_gpu_straggler GPUS "1+"
  MATCH "^keel run: rank 1 \\(host .*, pid [0-9]+, GPU cuda:[0-9]+ [0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\\.[0-9A-Fa-f]+\\) is a GPU straggler: its device takes"
  NOT "rank 0 .* is a (GPU )?straggler|rank 1 .* is a straggler"
  ARGS run ${rcfg} ${rshort} --ranks 2 --set device=cuda --set steps=30 --set batch.grad_accum=2 --set checkpoint.interval=0
       --set output_dir=run_cli/gpu_straggler --straggler-steps 3
       --inject slowgpu@10-30:r1:8 --inject slow@1-30:r0:150 --inject slow@1-30:r1:150)
set_tests_properties(cli_run_gpu_straggler PROPERTIES ENVIRONMENT "KEEL_NCCL_OVER_MPI=1"
                     FIXTURES_REQUIRED "train_stories;run_cli_clean")
add_test(NAME run_cli_clean COMMAND ${CMAKE_COMMAND} -E rm -rf run_cli)
set_tests_properties(run_cli_clean PROPERTIES FIXTURES_SETUP run_cli_clean)
set_tests_properties(cli_run_train_loss_spike cli_run_train_loss_spike_tp cli_run_train_disk_full
                     PROPERTIES FIXTURES_REQUIRED "train_stories;run_cli_clean")
add_test(NAME run_fault_drills
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/run/check_run.py $<TARGET_FILE:keel> ${rcfg} train_stories run_drills)
# Alone (RUN_SERIAL): the drills judge ranks by their speed against each other (the straggler
# watch, the pre-flight gate's fraction of the median), which other tests' threads on the same
# cores upset: under `scripts/gpu.sh test` (ctest -j 8 on a 32-core GPU machine, 2026-11-29) a
# fault-free run named a straggler and one rank's pre-flight GEMM fell to 0.19x the other's.
set_tests_properties(run_fault_drills PROPERTIES FIXTURES_REQUIRED train_stories TIMEOUT 600 PROCESSORS 2
                     RUN_SERIAL TRUE ENVIRONMENT "${KEEL_MPI_ENV}")
add_test(NAME run_drills_dir COMMAND ${CMAKE_COMMAND} -E make_directory run_drills)
set_tests_properties(run_drills_dir PROPERTIES FIXTURES_SETUP run_drills_dir)
set_tests_properties(run_fault_drills PROPERTIES FIXTURES_REQUIRED "train_stories;run_drills_dir")
