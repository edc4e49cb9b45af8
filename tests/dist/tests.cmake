# Multi-process tests of dist/ (label dist): ranks on 127.0.0.1 started by mn-run (examples/mn-run.cpp),
# each on a free port, so they may run in parallel. Included from tests/CMakeLists.txt.
if(NOT MN_GLOO_ENABLED OR NOT MN_BUILD_EXAMPLES)
  return()
endif()

add_executable(mn_dist_worker ${CMAKE_CURRENT_SOURCE_DIR}/dist/dist_worker.cpp)
target_link_libraries(mn_dist_worker PRIVATE mn::mapping_networks)
# Benchmark program, not a test: mn-run --nproc-per-node 2 mn_dist_bench (see its header).
add_executable(mn_dist_bench ${CMAKE_CURRENT_SOURCE_DIR}/dist/dist_bench.cpp)
target_link_libraries(mn_dist_bench PRIVATE mn::mapping_networks)
target_compile_definitions(mn_dist_bench PRIVATE MN_RUN_EXE="$<TARGET_FILE:mn-run>")  # for `compare`
add_dependencies(mn_dist_bench mn-run)

set(MN_DIST_WORKER $<TARGET_FILE:mn_dist_worker>)
set(MN_DIST_EXPECT_FAILURE ${CMAKE_CURRENT_SOURCE_DIR}/dist/expect_failure.cmake)
set(MN_RUN $<TARGET_FILE:mn-run>)

# mn_dist_test(<name> <nproc> <worker args>...): passes when every rank exits 0.
function(mn_dist_test name nproc)
  add_test(NAME ${name} COMMAND mn-run --nproc-per-node ${nproc} ${MN_DIST_WORKER} ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS dist TIMEOUT 120)
endfunction()

# mn_dist_failure_test(<name> <max seconds> <command, arguments joined by @@> <regex>...): passes when the command
# exits non-zero within the time and its output matches every regex.
function(mn_dist_failure_test name max_seconds command)
  set(index 0)
  set(expects)
  foreach(regex ${ARGN})
    list(APPEND expects "-DEXPECT${index}=${regex}")
    math(EXPR index "${index} + 1")
  endforeach()
  add_test(NAME ${name} COMMAND ${CMAKE_COMMAND} "-DCOMMAND=${command}" -DMAX_SECONDS=${max_seconds}
                                ${expects} -P ${MN_DIST_EXPECT_FAILURE})
  set_tests_properties(${name} PROPERTIES LABELS dist TIMEOUT 120)
endfunction()

foreach(nproc 2 3)
  mn_dist_test(dist_collectives_${nproc} ${nproc} collectives)
  mn_dist_test(dist_equivalence_${nproc} ${nproc} equivalence --steps 3)
  mn_dist_test(dist_equivalence_two_forwards_${nproc} ${nproc} equivalence --steps 3 --two-forwards)
  mn_dist_test(dist_equivalence_compile_${nproc} ${nproc} equivalence --steps 3 --compile)
  mn_dist_test(dist_no_sync_${nproc} ${nproc} no_sync)
endforeach()
# A plain nn::Module under DDP; gradient accumulation with sync off for all but the last micro-batch.
mn_dist_test(dist_module_equivalence_2 2 module_equivalence --steps 3)
mn_dist_test(dist_gradient_sync_2 2 gradient_sync)

# Mapper buffers built from different seeds: every rank refuses to wrap, naming the first differing group
# (MappingModel::replica_state).
mn_dist_failure_test(dist_buffer_mismatch_3 60
  "${MN_RUN}@@--nproc-per-node@@3@@${MN_DIST_WORKER}@@buffer_mismatch"
  "rank 0: error: DDP: the mapper buffers and scales of group '0' differ between rank 0 and rank 1"
  "rank 2: error: DDP: the mapper buffers and scales of group '0' differ between rank 0 and rank 1"
  "mn-run: failed: rank [0-9]")

# A rank dies mid-training. With SIGTERM ignored the survivors show their own error path (Gloo notices
# the dead peer, at the latest after the 10 s collective timeout); without, mn-run stops them at once.
mn_dist_failure_test(dist_kill_rank_survivors_2 60
  "${MN_RUN}@@--nproc-per-node@@2@@--grace-period@@60@@${MN_DIST_WORKER}@@kill@@--kill-rank@@1@@--after-step@@2@@--timeout@@10@@--ignore-sigterm"
  "rank 1 \\(pid [0-9]+\\) was killed by signal 9"
  "rank 0: training stopped at step 3, [0-9.]+ s after the last good step: DDP gradient all-reduce failed"
  "mn-run: failed: rank [0-9]")
mn_dist_failure_test(dist_kill_rank_survivors_3 60
  "${MN_RUN}@@--nproc-per-node@@3@@--grace-period@@60@@${MN_DIST_WORKER}@@kill@@--kill-rank@@1@@--after-step@@2@@--timeout@@10@@--ignore-sigterm"
  "rank 0: training stopped at step 3"
  "rank 2: training stopped at step 3"
  "rank 1 \\(pid [0-9]+\\) was killed by signal 9"
  "mn-run: failed: rank [0-9]")
mn_dist_failure_test(dist_kill_rank_launcher_3 30
  "${MN_RUN}@@--nproc-per-node@@3@@${MN_DIST_WORKER}@@kill@@--kill-rank@@2@@--after-step@@2@@--timeout@@10"
  "rank 2 \\(pid [0-9]+\\) was killed by signal 9"
  "mn-run: failed: rank 2 was killed by signal 9")
# Ranks that cannot notice the failure themselves are stopped by the launcher.
mn_dist_failure_test(dist_launcher_stops_others_3 30
  "${MN_RUN}@@--nproc-per-node@@3@@sh@@-c@@test $RANK = 1 && exit 3 || exec sleep 60"
  "rank 1 \\(pid [0-9]+\\) exited with code 3. stopping the other 2 rank"
  "rank 0 \\(pid [0-9]+\\) was killed by signal 15"
  "rank 2 \\(pid [0-9]+\\) was killed by signal 15"
  "mn-run: failed: rank 1 exited with code 3")
mn_dist_failure_test(dist_launcher_bad_program 30
  "${MN_RUN}@@--nproc-per-node@@2@@/nonexistent/program"
  "cannot execute '/nonexistent/program'"
  "exited with code 127")

# Signals sent to mn-run reach every rank; ranks that ignore SIGTERM/SIGINT get SIGKILL after the grace
# period (the test times out if any rank survives).
mn_dist_failure_test(dist_launcher_forwards_sigterm 20
  "timeout@@--preserve-status@@-s@@TERM@@1@@${MN_RUN}@@--nproc-per-node@@2@@sleep@@60"
  "mn-run: stopped by signal 15")
mn_dist_failure_test(dist_launcher_escalates_to_sigkill 20
  "timeout@@--preserve-status@@-s@@INT@@1@@${MN_RUN}@@--nproc-per-node@@3@@--grace-period@@1@@sh@@-c@@trap '' TERM INT && exec sleep 60"
  "mn-run: stopped by signal 2")

# Gloo's default event-loop scheduling (MN_GLOO_IO_THREAD=normal) still works.
add_test(NAME dist_collectives_gloo_io_normal_2
         COMMAND ${CMAKE_COMMAND} -E env MN_GLOO_IO_THREAD=normal
                 $<TARGET_FILE:mn-run> --nproc-per-node 2 ${MN_DIST_WORKER} collectives)
set_tests_properties(dist_collectives_gloo_io_normal_2 PROPERTIES LABELS dist TIMEOUT 120)

# --bind-cores: disjoint, equally large CPU sets per rank, OpenMP threads matching (needs 2 CPUs for 2 ranks).
cmake_host_system_information(RESULT mn_host_cpus QUERY NUMBER_OF_LOGICAL_CORES)
if(mn_host_cpus GREATER_EQUAL 2)
  add_test(NAME dist_launcher_bind_cores_2
           COMMAND ${CMAKE_COMMAND} -E env --unset=OMP_NUM_THREADS
                   $<TARGET_FILE:mn-run> --nproc-per-node 2 --bind-cores ${MN_DIST_WORKER} affinity)
  set_tests_properties(dist_launcher_bind_cores_2 PROPERTIES LABELS dist TIMEOUT 60)
endif()
mn_dist_failure_test(dist_launcher_bind_cores_too_many 30
  "${MN_RUN}@@--nproc-per-node@@1024@@--bind-cores@@true"
  "mn-run: --bind-cores needs at least one CPU per rank: 1024 ranks, [0-9]+ CPU.s. available")

# Bad or missing launcher variables give clear errors.
add_test(NAME dist_env_missing_rank
         COMMAND ${CMAKE_COMMAND} -E env --unset=RANK WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511
                 ${MN_DIST_WORKER} env)
set_tests_properties(dist_env_missing_rank PROPERTIES LABELS dist TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "environment variable RANK is not set")
add_test(NAME dist_env_bad_world_size
         COMMAND ${CMAKE_COMMAND} -E env RANK=0 WORLD_SIZE=abc MASTER_ADDR=127.0.0.1 MASTER_PORT=29511
                 ${MN_DIST_WORKER} env)
set_tests_properties(dist_env_bad_world_size PROPERTIES LABELS dist TIMEOUT 30
                     PASS_REGULAR_EXPRESSION "environment variable WORLD_SIZE='abc' is not a positive integer")

# mn-train under mn-run (examples/mn-train.cpp --backend): equivalence with one process, resume, errors.
if(TARGET mn-train)
  add_executable(mn_dist_train_test ${CMAKE_CURRENT_SOURCE_DIR}/dist/test_mn_train_ddp.cpp
                                    ${CMAKE_CURRENT_SOURCE_DIR}/main.cpp)
  target_link_libraries(mn_dist_train_test PRIVATE mn::mapping_networks doctest::doctest)
  target_compile_definitions(mn_dist_train_test PRIVATE MN_TRAIN_EXE="$<TARGET_FILE:mn-train>"
                                                        MN_RUN_EXE="$<TARGET_FILE:mn-run>")
  add_dependencies(mn_dist_train_test mn-train mn-run)
  add_test(NAME dist_mn_train COMMAND mn_dist_train_test --no-intro=true)
  set_tests_properties(dist_mn_train PROPERTIES LABELS dist TIMEOUT 300)
endif()

# mn-train --checkpoint-every under mn-run: a rank dies after a mid-epoch checkpoint (the hidden
# --crash-after-step hook, or SIGKILL from the test); the resumed job ends byte for byte as the straight one.
if(TARGET mn-train)
  add_executable(mn_dist_train_ckpt_test ${CMAKE_CURRENT_SOURCE_DIR}/dist/test_mn_train_ckpt_ddp.cpp
                                         ${CMAKE_CURRENT_SOURCE_DIR}/main.cpp)
  target_link_libraries(mn_dist_train_ckpt_test PRIVATE mn::mapping_networks doctest::doctest)
  target_compile_definitions(mn_dist_train_ckpt_test PRIVATE MN_TRAIN_EXE="$<TARGET_FILE:mn-train>"
                                                             MN_RUN_EXE="$<TARGET_FILE:mn-run>")
  add_dependencies(mn_dist_train_ckpt_test mn-train mn-run)
  add_test(NAME dist_mn_train_checkpoint COMMAND mn_dist_train_ckpt_test --no-intro=true)
  set_tests_properties(dist_mn_train_checkpoint PROPERTIES LABELS dist TIMEOUT 300)
endif()
