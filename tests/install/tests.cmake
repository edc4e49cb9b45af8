# install_consumer: installs this build into a scratch prefix, then configures, builds and runs a
# one-file downstream project that uses find_package(mapping_networks CONFIG REQUIRED). It checks the
# installed headers, the exported target and the package config together.
if(TARGET mapping_networks AND EXISTS ${PROJECT_SOURCE_DIR}/cmake/mn_install.cmake)
  add_test(NAME install_consumer
    COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run_consumer_test.sh
            ${CMAKE_COMMAND} ${PROJECT_BINARY_DIR} ${CMAKE_CURRENT_BINARY_DIR}/install_consumer
            ${CMAKE_CURRENT_LIST_DIR}/consumer ${CMAKE_CXX_COMPILER} $<CONFIG>)
  set_tests_properties(install_consumer PROPERTIES LABELS unit TIMEOUT 600)
endif()
