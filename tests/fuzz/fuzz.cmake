# Registers the fuzzers as the ctest tests fuzz_safetensors and fuzz_checkpoint (label unit). Included
# from tests/CMakeLists.txt. Each runs tests/fuzz/run_fuzz.sh, which builds its own clang++/libFuzzer
# binary (independent of the compiler this project is configured with), caching objects under the
# build tree, and fuzzes a fixed number of inputs from a fixed seed; it exits 77, reported as
# skipped, when clang++ or libFuzzer is missing.
find_program(MN_BASH_PROGRAM bash)
if(MN_BASH_PROGRAM)
  foreach(target safetensors checkpoint)
    add_test(NAME fuzz_${target} COMMAND ${MN_BASH_PROGRAM} ${CMAKE_CURRENT_LIST_DIR}/run_fuzz.sh ${target})
    set_tests_properties(fuzz_${target} PROPERTIES
      LABELS unit
      SKIP_RETURN_CODE 77
      # Both build in one directory (the engine objects are shared): never at the same time.
      RESOURCE_LOCK mn_fuzz_build
      # The first run compiles the engine objects (a few minutes on two idle cores); later runs reuse them.
      TIMEOUT 900
      ENVIRONMENT "MN_FUZZ_BUILD_DIR=${CMAKE_CURRENT_BINARY_DIR}/fuzz_build;EIGEN3_INCLUDE_DIR=${EIGEN3_INCLUDE_DIR}")
  endforeach()
endif()
