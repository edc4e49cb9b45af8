# bench_report: mn_bench_report (the `./mn bench` summary) on the synthetic results in
# tests/data/bench, see tests/bench/test_bench_report.cpp. Only where the report is built
# (MN_BUILD_BENCH with Google Benchmark, and nlohmann-json). Included from tests/CMakeLists.txt.
if(TARGET mn_bench_report)
  find_package(nlohmann_json 3 REQUIRED)  # found in bench/ already; imported targets are per directory
  add_executable(mn_bench_report_tests ${CMAKE_CURRENT_LIST_DIR}/test_bench_report.cpp ${CMAKE_CURRENT_LIST_DIR}/../main.cpp)
  target_link_libraries(mn_bench_report_tests PRIVATE doctest::doctest nlohmann_json::nlohmann_json)
  target_compile_definitions(mn_bench_report_tests PRIVATE MN_BENCH_REPORT="$<TARGET_FILE:mn_bench_report>"
                             MN_BENCH_TEST_DATA="${PROJECT_SOURCE_DIR}/tests/data/bench")
  add_dependencies(mn_bench_report_tests mn_bench_report)
  add_test(NAME bench_report COMMAND mn_bench_report_tests --no-intro=true)
  set_tests_properties(bench_report PROPERTIES LABELS unit TIMEOUT 120)
endif()
