# Registers the safetensors fuzzer as the ctest test fuzz_safetensors (label unit). Included from
# tests/CMakeLists.txt. The test runs tests/fuzz/run_fuzz.sh, which builds its own clang++/libFuzzer
# binary (independent of the compiler this project is configured with), caching objects under the
# build tree, and fuzzes 20000 inputs; it exits 77, reported as skipped, when clang++ or libFuzzer
# is missing.
find_program(MN_BASH_PROGRAM bash)
if(MN_BASH_PROGRAM)
  add_test(NAME fuzz_safetensors COMMAND ${MN_BASH_PROGRAM} ${CMAKE_CURRENT_LIST_DIR}/run_fuzz.sh)
  set_tests_properties(fuzz_safetensors PROPERTIES
    LABELS unit
    SKIP_RETURN_CODE 77
    # The first run compiles the engine objects (about a minute on two idle cores); later runs reuse them.
    TIMEOUT 900
    ENVIRONMENT "MN_FUZZ_BUILD_DIR=${CMAKE_CURRENT_BINARY_DIR}/fuzz_build;EIGEN3_INCLUDE_DIR=${EIGEN3_INCLUDE_DIR}")
endif()
