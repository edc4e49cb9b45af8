# GPU tests (label gpu): one executable; without a CUDA device it exits 77, which ctest reports as
# skipped (never as passed).
file(GLOB MN_GPU_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/gpu/test_*.cpp)
add_executable(mn_gpu_tests ${CMAKE_CURRENT_SOURCE_DIR}/gpu/main.cpp ${MN_GPU_TEST_SOURCES})
target_link_libraries(mn_gpu_tests PRIVATE mn::mapping_networks doctest::doctest)
if(MN_CUDA_ENABLED)
  # The tests call the runtime themselves (the library keeps it out of its interface).
  target_link_libraries(mn_gpu_tests PRIVATE CUDA::cudart)
endif()
add_test(NAME gpu_tests COMMAND mn_gpu_tests --no-intro=true --duration=true)
set_tests_properties(gpu_tests PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 240)
