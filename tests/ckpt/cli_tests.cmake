# `keel ckpt` as a user runs it: save at 4 ranks, load at 1, 2, 3 and 8 in other layouts
# (exit 0 means every element was bit-identical), the offline tools, and one clear error per
# bad input. Fault scenarios (a rank killed mid-save, corrupted and truncated files) are in
# ckpt/faults.sh.
set(ck ckpt_cli)
add_test(NAME cli_ckpt_clean COMMAND ${CMAKE_COMMAND} -E rm -rf ${ck})
set_tests_properties(cli_ckpt_clean PROPERTIES FIXTURES_SETUP ckpt_clean)

keel_cli_test(NAME ckpt_save4 NP 4 MATCH "saved step 20: stall [0-9.]+ ms \\(slowest rank\\), wrote .* GB/s"
  ARGS ckpt demo-save ${ck}/root --layout dp=2,tp=2,zero=1 --step 10 --saves 2 --every 10)
set_tests_properties(cli_ckpt_save4 PROPERTIES FIXTURES_REQUIRED ckpt_clean FIXTURES_SETUP ckpt_saved)

# ep is folded into dp*cp: a layout that leaves dp out fills it from the world ("ep=3" on 3 ranks
# is dp=3,ep=3; "ep=2,tp=2,zero=1" on 4 is dp=2,ep=2,tp=2, the experts over ep, ZeRO over the rest).
foreach(load "1;dp=1" "2;tp=2" "3;ep=3" "4;ep=2,tp=2,zero=1" "8;pp=2,ep=2,tp=2")
  list(GET load 0 np)
  list(GET load 1 layout)
  keel_cli_test(NAME ckpt_load${np} NP ${np} MATCH "read amplification 1\\.000"
    ARGS ckpt demo-load ${ck}/root --layout ${layout})
  set_tests_properties(cli_ckpt_load${np} PROPERTIES FIXTURES_REQUIRED ckpt_saved)
endforeach()
keel_cli_test(NAME ckpt_load_identical NP 3 MATCH "every element bit-identical to what was saved"
  ARGS ckpt demo-load ${ck}/root --layout dp=3,zero=1 --verify-checksums)
keel_cli_test(NAME ckpt_inspect MATCH "step_00000020  committed  <- latest" ARGS ckpt inspect ${ck}/root)
keel_cli_test(NAME ckpt_inspect_shards MATCH "data_r0000[0-3]_b[01]\\.bin @ [0-9]+ \\+[0-9]+  crc32c [0-9a-f]{8}"
  ARGS ckpt inspect ${ck}/root/step_00000010 --shards)
keel_cli_test(NAME ckpt_verify MATCH "verified .*checksums match, every element of every tensor stored exactly once"
  ARGS ckpt verify ${ck}/root --all)
keel_cli_test(NAME ckpt_reshard MATCH "resharded to pp=2,dp=3,ep=3 .* read amplification 1\\.000"
  ARGS ckpt reshard ${ck}/root ${ck}/resharded --to pp=2,dp=3,ep=3)
keel_cli_test(NAME ckpt_export MATCH "exported step 20: 52 tensors"
  ARGS ckpt export ${ck}/root ${ck}/model.safetensors --format safetensors)
keel_cli_test(NAME ckpt_save_committed_step EXIT 1 MATCH "keel: error: .*step 20 is already committed"
  ARGS ckpt demo-save ${ck}/root --step 20)
set_tests_properties(cli_ckpt_load_identical cli_ckpt_inspect cli_ckpt_inspect_shards cli_ckpt_verify cli_ckpt_reshard
  cli_ckpt_export cli_ckpt_save_committed_step PROPERTIES FIXTURES_REQUIRED ckpt_saved)
set_tests_properties(cli_ckpt_reshard PROPERTIES FIXTURES_SETUP ckpt_resharded)
set_tests_properties(cli_ckpt_export PROPERTIES FIXTURES_SETUP ckpt_exported)

keel_cli_test(NAME ckpt_load_resharded NP 6 MATCH "saved by 6 ranks in layout pp=2,dp=3,ep=3"
  ARGS ckpt demo-load ${ck}/resharded --layout tp=2,dp=3,zero=1)
set_tests_properties(cli_ckpt_load_resharded PROPERTIES FIXTURES_REQUIRED ckpt_resharded)
keel_cli_test(NAME ckpt_import MATCH "imported 52 tensors, .* as step 20"
  ARGS ckpt import ${ck}/model.safetensors ${ck}/imported --format safetensors)
set_tests_properties(cli_ckpt_import PROPERTIES FIXTURES_REQUIRED ckpt_exported FIXTURES_SETUP ckpt_imported)
keel_cli_test(NAME ckpt_load_imported NP 2 MATCH "every element bit-identical to what was saved"
  ARGS ckpt demo-load ${ck}/imported --layout ep=2)
set_tests_properties(cli_ckpt_load_imported PROPERTIES FIXTURES_REQUIRED ckpt_imported)

# A full disk on one rank: nothing commits, everyone exits 1 with one line naming rank and file.
keel_cli_test(NAME ckpt_enospc NP 2 EXIT 1
  MATCH "keel: error: (\\[rank 0\\] )?save of step 2 failed on 1 rank\\(s\\), nothing committed, the previous checkpoint stays: rank 1: cannot write .*data_r00001_b0\\.bin: No space left on device"
  ARGS ckpt demo-save ${ck}/enospc --step 1 --saves 2 --inject-enospc-rank 1)
set_tests_properties(cli_ckpt_enospc PROPERTIES FIXTURES_REQUIRED ckpt_clean)

# Bad input.
keel_cli_test(NAME ckpt_layout_world EXIT 1 NP 2 MATCH "keel: error: (\\[rank 0\\] )?layout 'tp=3': pp\\*cp\\*tsp\\*tp = 3 does not divide the 2 ranks"
  ARGS ckpt demo-load ${ck}/root --layout tp=3)
keel_cli_test(NAME ckpt_layout_world_dp EXIT 1 NP 2
  MATCH "keel: error: (\\[rank 0\\] )?layout 'dp=4' spans 4 ranks \\(pp\\*dp\\*cp\\*tsp\\*tp\\), but there are 2"
  ARGS ckpt demo-load ${ck}/root --layout dp=4)
keel_cli_test(NAME ckpt_layout_axis EXIT 1 MATCH "keel: error: layout 'mp=2': unknown axis 'mp'"
  ARGS ckpt demo-save ${ck}/x --layout mp=2)
keel_cli_test(NAME ckpt_missing EXIT 1 MATCH "keel: error: /nonexistent/ckpt: no such checkpoint"
  ARGS ckpt demo-load /nonexistent/ckpt)
keel_cli_test(NAME ckpt_format EXIT 1 MATCH "keel: error: unknown --format 'onnx'"
  ARGS ckpt export ${ck}/root ${ck}/m.onnx --format onnx)
keel_cli_test(NAME ckpt_import_garbage EXIT 1 MATCH "keel: error: .*faults\\.sh: .*not a safetensors file"
  ARGS ckpt import ${CMAKE_CURRENT_SOURCE_DIR}/ckpt/faults.sh ${ck}/garbage)

# Bad input that once damaged a checkpoint or wrote a wrong one with exit 0: each is now one
# line and exit 1, before anything is written.
keel_cli_test(NAME ckpt_export_into_checkpoint EXIT 1
  MATCH "keel: error: ${ck}/root/step_00000020/metadata\\.json: lies inside the checkpoint ${ck}/root/step_00000020 being exported"
  ARGS ckpt export ${ck}/root ${ck}/root/step_00000020/metadata.json)
keel_cli_test(NAME ckpt_export_exists EXIT 1
  MATCH "keel: error: ${ck}/model\\.safetensors: exists. pass --force to replace it"
  ARGS ckpt export ${ck}/root ${ck}/model.safetensors)
keel_cli_test(NAME ckpt_reshard_huge_mesh EXIT 1
  MATCH "keel: error: layout 'dp=65536,tp=65536': pp\\*dp\\*cp\\*tsp\\*tp = 4294967296 ranks, more than the 1048576 keel supports"
  ARGS ckpt reshard ${ck}/root ${ck}/huge --to dp=65536,tp=65536)
# ep takes no ranks of its own (folded into dp*cp): without a world to fill dp from, the old
# four-axis "pp=2,ep=3" is one clear error, not a 6-rank mesh (write pp=2,dp=3,ep=3).
keel_cli_test(NAME ckpt_reshard_ep_not_folded EXIT 1
  MATCH "keel: error: layout 'pp=2,ep=3': ep=3 does not divide dp\\*cp = 1 \\(expert parallelism is folded into the data and context ranks\\)"
  ARGS ckpt reshard ${ck}/root ${ck}/unfolded --to pp=2,ep=3)
keel_cli_test(NAME ckpt_reshard_zero2 EXIT 1
  MATCH "keel: error: layout 'dp=2,zero=2': zero=2 has no checkpoint layout \\(checkpoints know zero 0 and 1"
  ARGS ckpt reshard ${ck}/root ${ck}/zero2 --to dp=2,zero=2)
keel_cli_test(NAME ckpt_layout_repeated EXIT 1 MATCH "keel: error: layout 'tp=2,tp=4': tp is given twice"
  ARGS ckpt reshard ${ck}/root ${ck}/twice --to tp=2,tp=4)
keel_cli_test(NAME ckpt_reshard_into_existing_root EXIT 1
  MATCH "keel: error: ${ck}/root: already holds checkpoints \\(it has 'latest'\\): the destination must be a new checkpoint root"
  ARGS ckpt reshard ${ck}/root ${ck}/root --to tp=2)
keel_cli_test(NAME ckpt_import_into_existing_root EXIT 1
  MATCH "keel: error: ${ck}/root: already holds checkpoints \\(it has 'latest'\\)"
  ARGS ckpt import ${ck}/model.safetensors ${ck}/root)
keel_cli_test(NAME ckpt_import_negative_step EXIT 1 MATCH "keel: error: --step must be at least 0, got -7"
  ARGS ckpt import ${ck}/model.safetensors ${ck}/negative --step -7)
set_tests_properties(cli_ckpt_export_into_checkpoint cli_ckpt_reshard_huge_mesh cli_ckpt_reshard_ep_not_folded
  cli_ckpt_reshard_zero2 cli_ckpt_layout_world_dp cli_ckpt_layout_repeated
  cli_ckpt_reshard_into_existing_root PROPERTIES FIXTURES_REQUIRED ckpt_saved)
set_tests_properties(cli_ckpt_export_exists cli_ckpt_import_into_existing_root cli_ckpt_import_negative_step
  PROPERTIES FIXTURES_REQUIRED "ckpt_saved;ckpt_exported")
# --timeout as every keel command takes it (common/watchdog.h): 0 or inf is no deadline (0 was an
# error here, inf too; train took 0 and refused inf), a negative value one line.
keel_cli_test(NAME ckpt_timeout_zero MATCH "read amplification 1\\.000"
  ARGS ckpt demo-load ${ck}/root --timeout 0)
keel_cli_test(NAME ckpt_timeout_inf MATCH "read amplification 1\\.000"
  ARGS ckpt demo-load ${ck}/root --timeout inf)
set_tests_properties(cli_ckpt_timeout_zero cli_ckpt_timeout_inf PROPERTIES FIXTURES_REQUIRED ckpt_saved)
keel_cli_test(NAME ckpt_timeout_negative EXIT 1
  MATCH "^keel: error: --timeout -1: must be seconds >= 0 \\(0 or inf: no deadline\\)$"
  ARGS ckpt demo-save ${ck}/timeout --timeout -1)
keel_cli_test(NAME ckpt_negative_step EXIT 1 MATCH "keel: error: --step must be at least 0, got -5"
  ARGS ckpt demo-save ${ck}/negative --step -5)
keel_cli_test(NAME ckpt_bad_flush_behind EXIT 1 MATCH "^keel: error: --flush-behind-mib -1: must be >= 0 \\(0: off\\)$"
  ARGS ckpt demo-save ${ck}/flush --flush-behind-mib -1)
keel_cli_test(NAME ckpt_bad_probe EXIT 1 MATCH "^keel: error: --probe-ms nan: must be 0 \\(off\\) to 60000$"
  ARGS ckpt demo-save ${ck}/probe --probe-ms nan)
# --probe-ms: a step loop's small writes timed while the save writes (here a small window, so the
# write-behind path runs; the checkpoint loads back bit for bit in ckpt_probe_load).
keel_cli_test(NAME ckpt_probe NP 2 MATCH "probe \\(rank 0, a heartbeat rename \\+ a metrics append every 0.5 ms while writing\\): [0-9]+ pairs, median"
  ARGS ckpt demo-save ${ck}/probe --model layers=2,hidden=256,vocab=4096,experts=4,ffn=256 --flush-behind-mib 1
       --probe-ms 0.5)
keel_cli_test(NAME ckpt_probe_load MATCH "every element bit-identical to what was saved"
  ARGS ckpt demo-load ${ck}/probe --verify-checksums)
set_tests_properties(cli_ckpt_probe PROPERTIES FIXTURES_REQUIRED ckpt_clean FIXTURES_SETUP ckpt_probed)
set_tests_properties(cli_ckpt_probe_load PROPERTIES FIXTURES_REQUIRED ckpt_probed)

add_test(NAME cli_ckpt_faults COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/ckpt/faults.sh $<TARGET_FILE:keel> ${MPIEXEC_EXECUTABLE})
set_tests_properties(cli_ckpt_faults PROPERTIES ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 120)

# ZAYA1 weights under the released names (src/ckpt/zaya_names.*, docs/checkpoint.md): train the
# tiny ZAYA1 two steps, export its checkpoint as Hugging Face safetensors in both layouts, read
# them with the real safetensors package, import them back, and one clear error per bad input.
set(zcfg ${PROJECT_SOURCE_DIR}/configs/train/zaya1-tiny.yaml)
add_test(NAME cli_ckpt_zaya_clean COMMAND ${CMAKE_COMMAND} -E rm -rf ckpt_zaya)
set_tests_properties(cli_ckpt_zaya_clean PROPERTIES FIXTURES_SETUP ckpt_zaya_clean)
keel_cli_test(NAME ckpt_zaya_train MATCH "saved ckpt_zaya/train/step_00000002 "
  ARGS train ${zcfg} --set data.datasets.stories=train_stories --set eval.prefix=train_stories_heldout
       --set steps=2 --set log_interval=1 --set schedule.warmup_steps=1 --set data.seq_length=64
       --set batch.micro_batch=2 --set eval.interval=100 --set checkpoint.interval=2 --set output_dir=ckpt_zaya/train)
set_tests_properties(cli_ckpt_zaya_train PROPERTIES FIXTURES_REQUIRED "train_stories;ckpt_zaya_clean"
  FIXTURES_SETUP ckpt_zaya_trained)
keel_cli_test(NAME ckpt_zaya_export MATCH
  "exported step 2 of model 'zaya1-tiny' under zaya1 names: 67 tensors \\(bf16\\), .* -> ckpt_zaya/hf/model\\.safetensors \\(\\+ ckpt_zaya/hf/config\\.json\\)"
  ARGS ckpt export ckpt_zaya/train ckpt_zaya/hf --format safetensors --names zaya1 --model ${zcfg} --dtype bf16)
keel_cli_test(NAME ckpt_zaya_export_alternating MATCH
  "exported step 2 of model 'zaya1-tiny' under zaya1-alternating names: 79 tensors \\(f32\\)"
  ARGS ckpt export ckpt_zaya/train ckpt_zaya/alt --format safetensors --names zaya1-alternating --model ${zcfg})
set_tests_properties(cli_ckpt_zaya_export cli_ckpt_zaya_export_alternating PROPERTIES
  FIXTURES_REQUIRED ckpt_zaya_trained FIXTURES_SETUP ckpt_zaya_exported)
# The real safetensors package (numpy) reads both files; fails, not skips, without it.
add_test(NAME ckpt_zaya_safetensors_package_reads_export
         COMMAND python3 ${CMAKE_CURRENT_SOURCE_DIR}/ckpt/check_zaya_safetensors.py ckpt_zaya/hf ckpt_zaya/alt
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(ckpt_zaya_safetensors_package_reads_export PROPERTIES FIXTURES_REQUIRED ckpt_zaya_exported
  TIMEOUT 120)
keel_cli_test(NAME ckpt_zaya_import MATCH
  "imported zaya1-alternating weights into model 'zaya1-tiny': 65 keel tensors, .* as step 2 -> ckpt_zaya/imported/step_00000002"
  ARGS ckpt import ckpt_zaya/alt ckpt_zaya/imported --format safetensors --names zaya1-alternating --model ${zcfg})
set_tests_properties(cli_ckpt_zaya_import PROPERTIES FIXTURES_REQUIRED ckpt_zaya_exported FIXTURES_SETUP ckpt_zaya_imported)
# Released weights start a keel run (init_from: fresh optimizer, step 0) and decode; the import
# records its model (here --model, agreeing with the export's config.json), so --config may be
# left out, and one that disagrees is refused.
keel_cli_test(NAME ckpt_zaya_train_from_imported
  MATCH "^initialized from checkpoint ckpt_zaya/imported/step_00000002 \\(weights imported from ckpt_zaya/alt \\(zaya1-alternating names\\)\\)$"
  ARGS train ${zcfg} --set data.datasets.stories=train_stories --set eval.prefix=train_stories_heldout
       --set steps=1 --set data.seq_length=64 --set schedule.warmup_steps=0 --set batch.micro_batch=2
       --set checkpoint.final=false --set output_dir=ckpt_zaya/finetune --set init_from=ckpt_zaya/imported)
keel_cli_test(NAME ckpt_zaya_generate_from_imported
  MATCH "^model zaya1-tiny: .*. checkpoint ckpt_zaya/imported/step_00000002 \\(weights imported from ckpt_zaya/alt"
  ARGS generate ckpt_zaya/imported --config ${zcfg} --prompt "Tom ran" --max-new-tokens 4 --ignore-eos)
keel_cli_test(NAME ckpt_zaya_generate_imported_other_model EXIT 1
  MATCH "^keel: error: checkpoint ckpt_zaya/imported/step_00000002 holds model 'zaya1-tiny' \\(2 layers, hidden 256\\), not the model 'zaya1-tiny' given with it: vocab_size is 264 in the checkpoint, 1024 given$"
  ARGS generate ckpt_zaya/imported --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml --prompt "Tom ran" --max-new-tokens 4)
# Another RoPE than the imported model's is allowed in training (a context extension), and said.
keel_cli_test(NAME ckpt_zaya_train_from_imported_other_rope
  MATCH "^init_from ckpt_zaya/imported: this config's model differs from the one the checkpoint records: rope_base 10000 -> 5000000$"
  ARGS train ${zcfg} --set data.datasets.stories=train_stories --set eval.prefix=train_stories_heldout
       --set steps=1 --set data.seq_length=64 --set schedule.warmup_steps=0 --set batch.micro_batch=2
       --set checkpoint.final=false --set output_dir=ckpt_zaya/finetune_rope --set init_from=ckpt_zaya/imported
       --set model.rope_base=5.0e6)
set_tests_properties(cli_ckpt_zaya_train_from_imported cli_ckpt_zaya_generate_from_imported
  cli_ckpt_zaya_generate_imported_other_model cli_ckpt_zaya_train_from_imported_other_rope
  PROPERTIES FIXTURES_REQUIRED "ckpt_zaya_imported;train_stories")

# Issue 36: a release directory's config.json is its model. Import with no --model (the export's
# config.json, model named after its directory), then generate, eval and train from it with no
# model given anywhere.
keel_cli_test(NAME ckpt_zaya_import_by_config_json MATCH
  "^imported zaya1 weights into model 'hf': 65 keel tensors, .* as step 2 -> ckpt_zaya/from_json/step_00000002 \\(model from ckpt_zaya/hf/config\\.json\\)$"
  ARGS ckpt import ckpt_zaya/hf ckpt_zaya/from_json --names zaya1)
set_tests_properties(cli_ckpt_zaya_import_by_config_json PROPERTIES FIXTURES_REQUIRED ckpt_zaya_exported
  FIXTURES_SETUP ckpt_zaya_from_json)
keel_cli_test(NAME ckpt_zaya_generate_by_config_json
  MATCH "^model hf: .*. checkpoint ckpt_zaya/from_json/step_00000002 \\(weights imported from ckpt_zaya/hf \\(zaya1 names\\)\\)$"
  ARGS generate ckpt_zaya/from_json --prompt "Tom ran" --max-new-tokens 4 --ignore-eos --device cpu)
keel_cli_test(NAME ckpt_zaya_eval_by_config_json
  MATCH "^model hf: checkpoint ckpt_zaya/from_json/step_00000002 \\(weights imported from ckpt_zaya/hf \\(zaya1 names\\)\\). device cpu"
  ARGS eval ckpt_zaya/from_json --data train_stories_heldout --max-batches 1 --device cpu)
keel_cli_test(NAME ckpt_zaya_train_by_config_json
  MATCH "^initialized from checkpoint ckpt_zaya/from_json/step_00000002 \\(weights imported from ckpt_zaya/hf \\(zaya1 names\\)\\)$"
  NOT "differs from the one the checkpoint records"
  ARGS train ${CMAKE_CURRENT_SOURCE_DIR}/ckpt/data/finetune_no_model.yaml --set init_from=ckpt_zaya/from_json
       --set output_dir=ckpt_zaya/finetune_json)
set_tests_properties(cli_ckpt_zaya_generate_by_config_json cli_ckpt_zaya_eval_by_config_json
  cli_ckpt_zaya_train_by_config_json PROPERTIES FIXTURES_REQUIRED "ckpt_zaya_from_json;train_stories")
# A train config without `model:` needs an init_from checkpoint that records one (a demo one does not).
keel_cli_test(NAME ckpt_zaya_train_init_from_records_no_model EXIT 1
  MATCH "^keel: error: .*/finetune_no_model\\.yaml: missing key 'model' \\(init_from ${ck}/imported records no model: name it with 'model:'\\)$"
  ARGS train ${CMAKE_CURRENT_SOURCE_DIR}/ckpt/data/finetune_no_model.yaml --set init_from=${ck}/imported
       --set output_dir=ckpt_zaya/finetune_none)
set_tests_properties(cli_ckpt_zaya_train_init_from_records_no_model PROPERTIES FIXTURES_REQUIRED ckpt_imported)
# What config.json says keel cannot run is one line naming the key; no config.json needs --model.
keel_cli_test(NAME ckpt_zaya_import_refuses_yarn EXIT 1
  MATCH "^keel: error: .*/ckpt/data/release_yarn/config\\.json: 'rope_parameters\\.hybrid\\.rope_type' is \"yarn\": keel runs the default RoPE only$"
  ARGS ckpt import ${CMAKE_CURRENT_SOURCE_DIR}/ckpt/data/release_yarn ckpt_zaya/yarn --names zaya1)
keel_cli_test(NAME ckpt_zaya_import_without_config_json EXIT 1
  MATCH "^keel: error: ${ck}/model\\.safetensors: no config\\.json beside the weights: name the model with --model CONFIG\\.yaml$"
  ARGS ckpt import ${ck}/model.safetensors ckpt_zaya/no_json --names zaya1)
set_tests_properties(cli_ckpt_zaya_import_without_config_json PROPERTIES FIXTURES_REQUIRED ckpt_exported)
keel_cli_test(NAME ckpt_zaya_import_other_layout EXIT 1 MATCH
  "^keel: error: ckpt_zaya/hf/config\\.json: 'layer_types' is a key of the zaya1 layout's config: use --names zaya1$"
  ARGS ckpt import ckpt_zaya/hf ckpt_zaya/bad --names zaya1-alternating --model ${zcfg})
keel_cli_test(NAME ckpt_zaya_import_wrong_model EXIT 1 MATCH
  "^keel: error: ckpt_zaya/hf/config\\.json: describes another model than --model .*/configs/zaya1-tiny\\.yaml \\('zaya1-tiny'\\): vocab_size is 264 in config\\.json, 1024 in --model$"
  ARGS ckpt import ckpt_zaya/hf ckpt_zaya/bad --names zaya1 --model ${PROJECT_SOURCE_DIR}/configs/zaya1-tiny.yaml)
keel_cli_test(NAME ckpt_zaya_export_not_zaya EXIT 1 MATCH
  "keel: error: --names zaya1: model 'moe-tiny' layer 0 attention is not cca: not a ZAYA1-shaped model"
  ARGS ckpt export ckpt_zaya/train ckpt_zaya/bad --names zaya1 --model ${PROJECT_SOURCE_DIR}/configs/train/tiny.yaml)
set_tests_properties(cli_ckpt_zaya_import_other_layout cli_ckpt_zaya_import_wrong_model cli_ckpt_zaya_export_not_zaya
  PROPERTIES FIXTURES_REQUIRED ckpt_zaya_exported)
keel_cli_test(NAME ckpt_zaya_names_need_model EXIT 1 MATCH "keel: error: --names needs --model CONFIG\\.yaml"
  ARGS ckpt export ckpt_zaya/train ckpt_zaya/bad --names zaya1)
keel_cli_test(NAME ckpt_zaya_unknown_names EXIT 1 MATCH "keel: error: unknown --names 'llama' \\(zaya1, zaya1-alternating\\)"
  ARGS ckpt import ckpt_zaya/hf ckpt_zaya/bad --names llama --model ${zcfg})
keel_cli_test(NAME ckpt_zaya_unknown_dtype EXIT 1 MATCH "keel: error: unknown --dtype 'fp8' \\(fp32, bf16\\)"
  ARGS ckpt export ckpt_zaya/train ckpt_zaya/bad --names zaya1 --model ${zcfg} --dtype fp8)

# Issue 34: demo-load on a keel train checkpoint (tests/train's train_stop) read its state's
# `config`, the train YAML text, as demo sizes: "[json.exception.type_error.304] cannot use at()
# with string". It names the checkpoint and what it is instead.
keel_cli_test(NAME ckpt_demo_load_train_checkpoint EXIT 1
  MATCH "^keel: error: train_stop/step_[0-9]+: a keel train checkpoint \\(keel\\.train/[0-9]+\\), not a demo one: demo-load checks what keel ckpt demo-save wrote. use keel ckpt inspect or keel ckpt verify for this one$"
  NOT "json\\.exception"
  ARGS ckpt demo-load train_stop)
set_tests_properties(cli_ckpt_demo_load_train_checkpoint PROPERTIES FIXTURES_REQUIRED "train_stories;train_stop")
