# The door of `keel` (src/cli/main.cc) and its config readers, as a user meets them (issue 34):
# a mistyped or missing command names the word, the commands there are and the nearest one
# (CLI11 said only "A subcommand is required"); a config path that is no file is refused by name
# before anything is read (`keel train /dev/zero` read until the OOM killer; a directory given
# as a model YAML said "basic_filebuf::underflow error reading the file").
keel_cli_test(NAME unknown_command_suggests EXIT 1
  MATCH "^keel: error: unknown command 'trian' for keel: did you mean 'train'\\? \\(keel's commands: bench, size, ckpt, data, train, generate, eval, run\\)$"
  ARGS trian configs/train/tiny.yaml)
keel_cli_test(NAME unknown_command_far EXIT 1
  MATCH "^keel: error: unknown command 'frobnicate' for keel \\(keel's commands: bench, size, ckpt, data, train, generate, eval, run\\)$"
  NOT "did you mean|subcommand is required"
  ARGS frobnicate)
keel_cli_test(NAME unknown_subcommand EXIT 1
  MATCH "^keel: error: unknown command 'frobnicate' for keel ckpt \\(keel ckpt's commands: demo-save, demo-load, inspect, verify, reshard, export, import\\)$"
  ARGS ckpt frobnicate)
keel_cli_test(NAME unknown_subcommand_suggests EXIT 1
  MATCH "^keel: error: unknown command 'inspct' for keel data: did you mean 'inspect'\\? "
  ARGS data inspct some/prefix)
keel_cli_test(NAME missing_subcommand EXIT 1
  MATCH "^keel: error: keel bench: missing command \\(one of: comm, mem, gemm, kernels, linattn. see keel bench --help\\)$"
  ARGS bench)
keel_cli_test(NAME train_dev_zero EXIT 1
  MATCH "^keel: error: cannot read /dev/zero: it is a character device, not a config file$"
  ARGS train /dev/zero)
keel_cli_test(NAME size_directory EXIT 1
  MATCH "^keel: error: cannot read .*/configs: it is a directory, not a config file$"
  ARGS size ${PROJECT_SOURCE_DIR}/configs)
