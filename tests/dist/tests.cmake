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

# Benchmark program, not a test: mn_store_bench (the job token's handshake cost, set/get latency).
add_executable(mn_store_bench ${CMAKE_CURRENT_SOURCE_DIR}/dist/store_bench.cpp)
target_link_libraries(mn_store_bench PRIVATE mn::mapping_networks)

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

# ---- store security and backend agreement (issue 20 sections 4 and 5) ----
# Ranks that chose different backends: every rank fails with one message naming them, before any backend's
# rendezvous (nccl is not in a CPU build: the disagreement must be found first).
mn_dist_failure_test(dist_backend_mismatch_2 60
  "${MN_RUN}@@--nproc-per-node@@2@@${MN_DIST_WORKER}@@backend_mismatch@@--backends@@gloo,nccl"
  "rank 0: error: setup_ddp: rank 1 chose backend 'nccl' but rank 0 chose 'gloo'; every rank must use the same backend"
  "rank 1: error: setup_ddp: rank 1 chose backend 'nccl' but rank 0 chose 'gloo'; every rank must use the same backend")
mn_dist_failure_test(dist_backend_mismatch_3 60
  "${MN_RUN}@@--nproc-per-node@@3@@${MN_DIST_WORKER}@@backend_mismatch@@--backends@@gloo,gloo,ucc"
  "rank 0: error: setup_ddp: rank 2 chose backend 'ucc' but rank 0 chose 'gloo'"
  "rank 1: error: setup_ddp: rank 2 chose backend 'ucc' but rank 0 chose 'gloo'"
  "rank 2: error: setup_ddp: rank 2 chose backend 'ucc' but rank 0 chose 'gloo'")
# The whole job with a job token (every rank proves it to the launcher's store).
add_test(NAME dist_collectives_job_token_2
         COMMAND ${CMAKE_COMMAND} -E env MN_JOB_TOKEN=dist-test-secret
                 $<TARGET_FILE:mn-run> --nproc-per-node 2 ${MN_DIST_WORKER} collectives)
set_tests_properties(dist_collectives_job_token_2 PROPERTIES LABELS dist TIMEOUT 120)
# mn-run serves the store (with the launcher's token); rank 1 brings another one and is refused.
mn_dist_failure_test(dist_job_token_mismatch_2 60
  "${CMAKE_COMMAND}@@-E@@env@@MN_JOB_TOKEN=job-secret@@${MN_RUN}@@--nproc-per-node@@2@@sh@@-c@@[ \"$RANK\" != 1 ] || export MN_JOB_TOKEN=another-secret && exec ${MN_DIST_WORKER} collectives"
  "rank 1: error: the store at 127.0.0.1:[0-9]+ refused this rank's job token"
  "mn store \\(port [0-9]+\\): refused the connection from 127.0.0.1:[0-9]+: wrong job token")
# mn-run --job-token-file: the token from a mode-600 file for the launcher and the ranks.
add_test(NAME dist_job_token_file_2
         COMMAND ${MN_BASH_PROGRAM} ${CMAKE_CURRENT_SOURCE_DIR}/dist/job_token_file.sh $<TARGET_FILE:mn-run> ${MN_DIST_WORKER})
set_tests_properties(dist_job_token_file_2 PROPERTIES LABELS dist TIMEOUT 120)

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

# mn-run's own command line: options before the program are parsed strictly (an unknown one is an error,
# not the program), `--` ends them.
mn_dist_failure_test(dist_launcher_unknown_option 30
  "${MN_RUN}@@--nproc@@2@@true"
  "The following argument was not expected: --nproc")
add_test(NAME dist_launcher_double_dash COMMAND mn-run --nproc-per-node 2 -- sh -c "test $WORLD_SIZE = 2")
set_tests_properties(dist_launcher_double_dash PROPERTIES LABELS dist TIMEOUT 30)

# --max-restarts: rank 1 fails in the first attempt, all ranks start again in a fresh namespace of the
# launcher's store (TORCHELASTIC_RESTART_COUNT=1) and pass; when every attempt fails, the last failure is
# reported with the restarts used.
add_test(NAME dist_launcher_restart_2
         COMMAND mn-run --nproc-per-node 2 --max-restarts 1 ${MN_DIST_WORKER} restart --fail-rank 1)
set_tests_properties(dist_launcher_restart_2 PROPERTIES LABELS dist TIMEOUT 60
                     PASS_REGULAR_EXPRESSION "mn-run: restart 1/1 after rank 1 exited with code 1")
mn_dist_failure_test(dist_launcher_restarts_exhausted_2 60
  "${MN_RUN}@@--nproc-per-node@@2@@--max-restarts@@2@@${MN_DIST_WORKER}@@restart@@--fail-rank@@1@@--fail-attempts@@3"
  "mn-run: restart 1/2 after rank 1 exited with code 1"
  "mn-run: restart 2/2 after rank 1 exited with code 1"
  "mn-run: failed: rank 1 exited with code 1 first \\(after 2 restart\\(s\\), --max-restarts 2\\)")

# Two mn-run processes as two nodes on 127.0.0.1 (tests/dist/test_multinode.cpp), one CTest test per case.
add_executable(mn_dist_multinode_test ${CMAKE_CURRENT_SOURCE_DIR}/dist/test_multinode.cpp
                                      ${CMAKE_CURRENT_SOURCE_DIR}/main.cpp)
target_link_libraries(mn_dist_multinode_test PRIVATE mn::mapping_networks doctest::doctest)
target_compile_definitions(mn_dist_multinode_test PRIVATE MN_RUN_EXE="$<TARGET_FILE:mn-run>"
                           MN_DIST_WORKER_EXE="$<TARGET_FILE:mn_dist_worker>" MN_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_dependencies(mn_dist_multinode_test mn-run mn_dist_worker)
set(mn_multinode_cases "two nodes x 1 rank*" "two nodes x 2 ranks*" "a node that never arrives*"
    "a rank killed on node 1*" "a rank killed in the middle*" "a launcher killed on node 1*"
    "--max-restarts: both nodes*" "the Slurm recipe*")
# mn-train --auto-resume restarted on two nodes: with a directory per node the ranks refuse to train from
# different positions; with a shared one the job resumes.
if(TARGET mn-train)
  target_compile_definitions(mn_dist_multinode_test PRIVATE MN_TRAIN_EXE="$<TARGET_FILE:mn-train>")
  add_dependencies(mn_dist_multinode_test mn-train)
  list(APPEND mn_multinode_cases "mn-train --auto-resume on two nodes without*" "mn-train --auto-resume on two nodes sharing*")
endif()
foreach(case ${mn_multinode_cases})
  string(TOLOWER "${case}" id)
  string(REGEX REPLACE "[^a-z0-9]+" "_" id "${id}")
  string(REGEX REPLACE "^_|_$" "" id "${id}")
  add_test(NAME dist_multinode_${id} COMMAND mn_dist_multinode_test --no-intro=true "--test-case=${case}")
  # A pattern that matches no case would pass silently.
  set_tests_properties(dist_multinode_${id} PROPERTIES LABELS dist TIMEOUT 90
                       FAIL_REGULAR_EXPRESSION "test cases: +0 [|]")
endforeach()
# ---- the MPI backend (builds with MPI): the worker's Gloo checks over MPI, ranks started by mpirun ----
# Open MPI refuses to run as root without --allow-run-as-root and more ranks than cores without
# --oversubscribe; --bind-to none leaves placement to the scheduler (tests run side by side). Its default
# transports (shared memory between the ranks of one machine) work here; nothing else needs setting.
if(MN_MPI_ENABLED AND MPIEXEC_EXECUTABLE)
  set(MN_MPIRUN ${MPIEXEC_EXECUTABLE})
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE mn_mpirun_version ERROR_QUIET)
  if(mn_mpirun_version MATCHES "Open MPI|OpenRTE")
    list(APPEND MN_MPIRUN --allow-run-as-root --oversubscribe --bind-to none)
  endif()
  string(JOIN "@@" MN_MPIRUN_JOINED ${MN_MPIRUN})

  # mn_mpi_test(<name> <nproc> <worker args>...): passes when every rank exits 0.
  function(mn_mpi_test name nproc)
    add_test(NAME ${name} COMMAND ${MN_MPIRUN} ${MPIEXEC_NUMPROC_FLAG} ${nproc} ${MN_DIST_WORKER} ${ARGN} --backend mpi)
    set_tests_properties(${name} PROPERTIES LABELS dist TIMEOUT 120)
  endfunction()
  foreach(nproc 2 3)
    mn_mpi_test(mpi_collectives_${nproc} ${nproc} collectives)
    mn_mpi_test(mpi_equivalence_${nproc} ${nproc} equivalence --steps 3)
    mn_mpi_test(mpi_equivalence_two_forwards_${nproc} ${nproc} equivalence --steps 3 --two-forwards)
    mn_mpi_test(mpi_equivalence_compile_${nproc} ${nproc} equivalence --steps 3 --compile)
    mn_mpi_test(mpi_no_sync_${nproc} ${nproc} no_sync)
  endforeach()
  mn_mpi_test(mpi_module_equivalence_2 2 module_equivalence --steps 3)
  mn_mpi_test(mpi_module_equivalence_3 3 module_equivalence --steps 3)
  mn_mpi_test(mpi_gradient_sync_2 2 gradient_sync)
  mn_dist_failure_test(mpi_buffer_mismatch_3 60
    "${MN_MPIRUN_JOINED}@@${MPIEXEC_NUMPROC_FLAG}@@3@@${MN_DIST_WORKER}@@buffer_mismatch@@--backend@@mpi"
    "rank 0: error: DDP: the mapper buffers and scales of group '0' differ between rank 0 and rank 1")
  # A rank killed mid-training: mpirun stops the job (the survivors do not wait for a collective timeout).
  mn_dist_failure_test(mpi_kill_rank_3 30
    "${MN_MPIRUN_JOINED}@@${MPIEXEC_NUMPROC_FLAG}@@3@@${MN_DIST_WORKER}@@kill@@--kill-rank@@1@@--after-step@@2@@--timeout@@60@@--backend@@mpi"
    "rank 1: raising SIGKILL after step 2")
  # A rank that stops calling collectives: the others' wait fails after the collective timeout (2 s), the
  # group is broken, and the job ends long before the stalled rank would have woken up.
  mn_dist_failure_test(mpi_collective_timeout_2 30
    "${MN_MPIRUN_JOINED}@@${MPIEXEC_NUMPROC_FLAG}@@2@@${MN_DIST_WORKER}@@stall@@--stall-rank@@1@@--stall-seconds@@60@@--timeout@@2@@--backend@@mpi"
    "rank 0: all-reduce failed after 2.[0-9]+ s: MPI allreduce of 16 f32 elements .sum. on rank 0 of 2 did not complete within the collective timeout of 2 s"
    "rank 0: then: MPI barrier on rank 0 of 2 was not run: the process group is broken")
  # setup_ddp's rank must be MPI's: one process started without mpirun is rank 0 of 1.
  add_test(NAME mpi_rank_mismatch
           COMMAND ${CMAKE_COMMAND} -E env RANK=1 WORLD_SIZE=2 ${MN_DIST_WORKER} collectives --backend mpi)
  set_tests_properties(mpi_rank_mismatch PROPERTIES LABELS dist TIMEOUT 60
                       PASS_REGULAR_EXPRESSION "asked for rank 1 of 2 .*but MPI started this process as rank 0 of 1")

  # mn-train --backend mpi under mpirun (tests/dist/test_mn_train_ddp.cpp's cases under MN_MPIRUN_NP).
  if(TARGET mn_dist_train_test)
    string(JOIN " " mn_mpirun_command ${MN_MPIRUN} ${MPIEXEC_NUMPROC_FLAG})
    target_compile_definitions(mn_dist_train_test PRIVATE MN_MPIRUN_NP="${mn_mpirun_command}")
  endif()
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
  set_tests_properties(dist_mn_train_checkpoint PROPERTIES LABELS dist TIMEOUT 450)
endif()
