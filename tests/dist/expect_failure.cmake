# cmake -DCOMMAND="prog@@arg@@..." -DMAX_SECONDS=60 -DEXPECT0=regex [-DEXPECT1=...] -P expect_failure.cmake
# Runs the command (arguments separated by @@, which no shell snippet contains) and fails unless it exits
# non-zero within MAX_SECONDS and its stdout + stderr match every EXPECT<i> regex.
string(REPLACE "@@" ";" command "${COMMAND}")
string(TIMESTAMP start "%s" UTC)
execute_process(COMMAND ${command} RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${MAX_SECONDS})
string(TIMESTAMP stop "%s" UTC)
math(EXPR elapsed "${stop} - ${start}")
set(output "${out}${err}")
message("---- output (${elapsed} s, result '${result}') ----\n${output}----")
if(NOT result MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the command did not exit normally within ${MAX_SECONDS} s: ${result}")
endif()
if(result EQUAL 0)
  message(FATAL_ERROR "the command succeeded; a failure was expected")
endif()
foreach(i RANGE 0 9)
  if(DEFINED EXPECT${i} AND NOT output MATCHES "${EXPECT${i}}")
    message(FATAL_ERROR "the output does not match '${EXPECT${i}}'")
  endif()
endforeach()
