# keel against Hugging Face transformers' ZayaForCausalLM (tests/reference/hf_zaya_check.py,
# docs/checkpoint.md "Checked against transformers"): weights from a random ZayaForCausalLM through
# keel ckpt import --names zaya1 (and back through export), then
#   reference_hf_zaya_forward: keel eval's fp32 forward (CE 1e-5 relative, every token's log-prob
#     1e-4) and keel generate's greedy tokens against transformers, two tiny ZAYA1 models with a
#     quarter of the tokens on the skip class (~20 s on 2 cores);
#   reference_hf_zaya_train: 5 keel train steps (CPU, AdamW, clipping, fixed balancing biases)
#     against the same steps in transformers: losses 1e-5 relative, routing counts identical (~10 s).
# The interpreter: $KEEL_REFERENCE_PYTHON, else .venv-ref/bin/python (scripts/setup.sh --reference);
# without torch and transformers both skip (exit 77). `ctest -L reference` runs just these.
foreach(mode forward train)
  add_test(NAME reference_hf_zaya_${mode}
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/reference/run_reference.sh ${mode} $<TARGET_FILE:keel>
                   ${PROJECT_SOURCE_DIR} ${CMAKE_CURRENT_BINARY_DIR}/reference_hf_zaya_${mode}
           WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
  set_tests_properties(reference_hf_zaya_${mode} PROPERTIES ENVIRONMENT "${KEEL_MPI_ENV}" TIMEOUT 300
                       SKIP_RETURN_CODE 77 LABELS reference PROCESSORS 2)
endforeach()
