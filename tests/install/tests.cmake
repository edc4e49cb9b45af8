# install_consumer: installs this build into a scratch prefix, then configures, builds and runs a
# one-file downstream project that uses find_package(mapping_networks CONFIG REQUIRED). It checks the
# installed headers, the exported targets, the package config and the installed tools together: no
# build-machine path or -march=native reaches the consumer, and no CUDA library when this build has
# no CUDA (see run_consumer_test.sh).
if(TARGET mapping_networks AND EXISTS ${PROJECT_SOURCE_DIR}/cmake/mn_install.cmake)
  if(MN_CUDA_ENABLED)
    # The toolkit directory this build took CUDA from (bin/nvcc's parent).
    get_filename_component(mn_build_cuda_root ${CUDAToolkit_BIN_DIR} DIRECTORY)
  else()
    set(mn_build_cuda_root -)
  endif()
  string(REPLACE ";" "," mn_tools "${MN_INSTALLED_TOOLS}")
  add_test(NAME install_consumer
    COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run_consumer_test.sh
            ${CMAKE_COMMAND} ${PROJECT_BINARY_DIR} ${CMAKE_CURRENT_BINARY_DIR}/install_consumer
            ${CMAKE_CURRENT_LIST_DIR}/consumer ${CMAKE_CXX_COMPILER} $<CONFIG> ${mn_build_cuda_root}
            "${mn_tools}" ${PROJECT_SOURCE_DIR})
  set_tests_properties(install_consumer PROPERTIES LABELS unit TIMEOUT 600)
endif()
