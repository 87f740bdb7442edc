# `keel data` as a user runs it: tokenize the shipped corpus, inspect it, walk batches; and one
# clear error line (naming the file, and the line where there is one) per bad input.
set(corpus ${PROJECT_SOURCE_DIR}/data/corpus)
set(din ${CMAKE_CURRENT_SOURCE_DIR}/data/inputs)

# (--force on the fixtures that write a fixed prefix: a rerun of the suite replaces the last run's)
keel_cli_test(NAME data_tokenize_jsonl
  MATCH "tokenized 1 file: 220 documents, [0-9]+ tokens \\(byte tokenizer, vocab 259, uint16\\)"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_stories --append-eos --force)
set_tests_properties(cli_data_tokenize_jsonl PROPERTIES FIXTURES_SETUP data_stories)
keel_cli_test(NAME data_tokenize_bad_holdout EXIT nonzero MATCH "--holdout must be in .0, 1\\), got 1.5"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_bad_holdout --holdout 1.5)
keel_cli_test(NAME data_tokenize_holdout_too_small EXIT nonzero MATCH "none of the 220 documents was held out"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_tiny_holdout --holdout 0.0001)
# The prefix's directory is created when missing (as the quickstart's out/corpus/ is).
add_test(NAME cli_data_tokenize_new_dir_clean COMMAND ${CMAKE_COMMAND} -E rm -rf data_new_dir
         WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_data_tokenize_new_dir_clean PROPERTIES FIXTURES_SETUP data_new_dir_clean)
keel_cli_test(NAME data_tokenize_new_dir MATCH "wrote data_new_dir/a/stories\\.bin and data_new_dir/a/stories\\.idx"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_new_dir/a/stories)
set_tests_properties(cli_data_tokenize_new_dir PROPERTIES FIXTURES_REQUIRED data_new_dir_clean)
keel_cli_test(NAME data_inspect
  MATCH "text \"(Once upon a time|[A-Z][a-z]+ and a |In ).*</s>\"$"
  ARGS data inspect data_stories --tokens 100000)
keel_cli_test(NAME data_inspect_summary MATCH "^documents +220$" ARGS data inspect data_stories)
set_tests_properties(cli_data_inspect cli_data_inspect_summary PROPERTIES FIXTURES_REQUIRED data_stories)

keel_cli_test(NAME data_tokenize_text MATCH "tokenized 2 files: 520 documents, .*uint32\\)"
  ARGS data tokenize ${corpus}/stories.txt ${corpus}/arithmetic.txt --out data_text --dtype uint32 --force)
set_tests_properties(cli_data_tokenize_text PROPERTIES FIXTURES_SETUP data_text)
keel_cli_test(NAME data_inspect_uint32 MATCH "^dtype +uint32 \\(Megatron dtype code 9\\)$"
  ARGS data inspect data_text --document 300)
set_tests_properties(cli_data_inspect_uint32 PROPERTIES FIXTURES_REQUIRED data_text)

# Bad input.
keel_cli_test(NAME data_tokenize_missing EXIT 1 MATCH "^keel: error: cannot read input .*nope\\.txt: No such file or directory$"
  ARGS data tokenize ${corpus}/stories.txt ${din}/nope.txt --out data_never)
keel_cli_test(NAME data_tokenize_bad_jsonl EXIT 1 MATCH "^keel: error: .*bad\\.jsonl:3: not a JSON line \\("
  ARGS data tokenize ${din}/bad.jsonl --out data_never)
keel_cli_test(NAME data_tokenize_no_key EXIT 1 MATCH "^keel: error: .*no_key\\.jsonl:2: no string field 'text'"
  ARGS data tokenize ${din}/no_key.jsonl --out data_never)
keel_cli_test(NAME data_tokenize_other_key EXIT 1 MATCH "no_key\\.jsonl:1: no string field 'body'"
  ARGS data tokenize ${din}/no_key.jsonl --jsonl-key body --out data_never)
keel_cli_test(NAME data_tokenize_empty EXIT 1 MATCH "^keel: error: no documents in the input \\(.*empty\\.txt\\): nothing to write$"
  ARGS data tokenize ${din}/empty.txt --out data_never)
keel_cli_test(NAME data_tokenize_spm_missing EXIT 1
  MATCH "^keel: error: cannot read SentencePiece model .*missing\\.model: no such file$"
  ARGS data tokenize ${corpus}/stories.txt --tokenizer spm:${din}/missing.model --out data_never)
keel_cli_test(NAME data_tokenize_bad_tokenizer EXIT 1 MATCH "unknown tokenizer 'gpt2' \\(byte or spm:MODEL_FILE\\)"
  ARGS data tokenize ${corpus}/stories.txt --tokenizer gpt2 --out data_never)
keel_cli_test(NAME data_tokenize_bad_dtype EXIT 1 MATCH "unknown token dtype 'int8'"
  ARGS data tokenize ${corpus}/stories.txt --dtype int8 --out data_never)
keel_cli_test(NAME data_inspect_missing EXIT 1 MATCH "^keel: error: cannot open .*data_nothing\\.idx: No such file or directory$"
  ARGS data inspect data_nothing)
keel_cli_test(NAME data_batches_unknown_key EXIT 1
  MATCH "^keel: error: .*unknown_key\\.yaml: unknown key 'weight' in phase 1 \\(allowed: name, tokens, weights\\) \\(line 7\\)$"
  ARGS data batches ${din}/unknown_key.yaml)
keel_cli_test(NAME data_batches_missing_dataset EXIT 1
  MATCH "^keel: error: cannot open .*inputs/no_such_dataset\\.idx: No such file or directory$"
  ARGS data batches ${din}/missing_dataset.yaml)

# Truncated datasets, a two-dataset phased blend, resume and world-size independence end to end.
add_test(NAME cli_data_pipeline COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/data/check_pipeline.sh $<TARGET_FILE:keel> ${corpus})
set_tests_properties(cli_data_pipeline PROPERTIES TIMEOUT 120)

# A held-out split left by an earlier --holdout run would overlap a re-tokenized training set:
# refused, and nothing is written. Negative counts and an empty prefix are refused too.
add_test(NAME cli_data_split_clean COMMAND ${CMAKE_COMMAND} -E rm -rf data_split WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_data_split_clean PROPERTIES FIXTURES_SETUP data_split_clean)
keel_cli_test(NAME data_tokenize_split MATCH "held out 13 documents"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_split/s --holdout 0.05)
set_tests_properties(cli_data_tokenize_split PROPERTIES FIXTURES_REQUIRED data_split_clean FIXTURES_SETUP data_split)
keel_cli_test(NAME data_tokenize_stale_holdout EXIT nonzero
  MATCH "data_split/s_heldout\\.bin is left from an earlier --holdout split of data_split/s: it would overlap"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_split/s)
set_tests_properties(cli_data_tokenize_stale_holdout PROPERTIES FIXTURES_REQUIRED data_split)
keel_cli_test(NAME data_tokenize_directory_prefix EXIT nonzero MATCH "--out 'data_none/': must name a file prefix"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_none/)
keel_cli_test(NAME data_inspect_negative_document EXIT nonzero MATCH "--document: must not be negative"
  ARGS data inspect data_stories --document -1)
set_tests_properties(cli_data_inspect_negative_document PROPERTIES FIXTURES_REQUIRED data_stories)

# Issue 34: an existing dataset is replaced only with --force (it was replaced without a word),
# and `tokenize X.bin --out X`, which replaced its own input, is refused; the refusals leave the
# dataset as it was.
add_test(NAME cli_data_force_clean COMMAND ${CMAKE_COMMAND} -E rm -rf data_force WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
set_tests_properties(cli_data_force_clean PROPERTIES FIXTURES_SETUP data_force_clean)
keel_cli_test(NAME data_force_first MATCH "wrote data_force/s\\.bin and data_force/s\\.idx"
  ARGS data tokenize ${corpus}/stories.jsonl --out data_force/s)
set_tests_properties(cli_data_force_first PROPERTIES FIXTURES_REQUIRED data_force_clean FIXTURES_SETUP data_force)
keel_cli_test(NAME data_tokenize_existing_refused EXIT 1
  MATCH "^keel: error: --out data_force/s: data_force/s\\.bin already exists \\(an earlier dataset\\?\\): pass --force to replace it, or choose another prefix$"
  ARGS data tokenize ${corpus}/arithmetic.jsonl --out data_force/s)
keel_cli_test(NAME data_tokenize_own_input_refused EXIT 1
  MATCH "^keel: error: --out data_force/s would replace the input data_force/s\\.bin \\(as data_force/s\\.bin\\) with its tokens: give another --out \\(or --force\\)$"
  ARGS data tokenize data_force/s.bin --out data_force/s)
keel_cli_test(NAME data_tokenize_refusals_kept MATCH "^documents +220$" ARGS data inspect data_force/s)
keel_cli_test(NAME data_tokenize_force MATCH "tokenized 1 file: 300 documents"
  ARGS data tokenize ${corpus}/arithmetic.jsonl --out data_force/s --force)
set_tests_properties(cli_data_tokenize_existing_refused cli_data_tokenize_own_input_refused cli_data_tokenize_refusals_kept
  cli_data_tokenize_force PROPERTIES FIXTURES_REQUIRED data_force)
set_tests_properties(cli_data_tokenize_refusals_kept PROPERTIES
  DEPENDS "cli_data_tokenize_existing_refused;cli_data_tokenize_own_input_refused")
set_tests_properties(cli_data_tokenize_force PROPERTIES DEPENDS cli_data_tokenize_refusals_kept)
