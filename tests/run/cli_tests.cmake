# `keel run`, the supervisor: bad flags are one line; the fault drills on 2 CPU ranks
# (tests/run/check_run.py: kill, hang, NaN, give up, SIGTERM; about a minute).
set(rcfg ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml)
keel_cli_test(NAME run_bad_max_restarts EXIT 1 MATCH "--max-restarts -1: must be >= 0"
  ARGS run ${rcfg} --max-restarts -1)
keel_cli_test(NAME run_bad_hang_factor EXIT 1 MATCH "--hang-factor 0.5: must be >= 1"
  ARGS run ${rcfg} --hang-factor 0.5)
keel_cli_test(NAME run_bad_launcher EXIT 1 MATCH "--launcher srun: keel run launches with mpirun"
  ARGS run ${rcfg} --launcher srun)
keel_cli_test(NAME run_bad_inject EXIT 1 MATCH "--inject kil@3: unknown fault 'kil'"
  ARGS run ${rcfg} --inject kil@3)
keel_cli_test(NAME run_inside_a_launcher_is_refused NP 2 EXIT 1
  MATCH "keel run is the supervisor, not a rank" ARGS run ${rcfg})
add_test(NAME run_fault_drills
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/run/check_run.py $<TARGET_FILE:keel> ${rcfg} train_stories run_drills)
set_tests_properties(run_fault_drills PROPERTIES FIXTURES_REQUIRED train_stories TIMEOUT 600 PROCESSORS 2
                     ENVIRONMENT "${KEEL_MPI_ENV}")
add_test(NAME run_drills_dir COMMAND ${CMAKE_COMMAND} -E make_directory run_drills)
set_tests_properties(run_drills_dir PROPERTIES FIXTURES_SETUP run_drills_dir)
set_tests_properties(run_fault_drills PROPERTIES FIXTURES_REQUIRED "train_stories;run_drills_dir")
