# Installs the library, its public headers and a CMake package, so that another project writes
#   find_package(mapping_networks CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE mn::mapping_networks)
# and gets the same target name as a project that uses add_subdirectory (the alias mn::mapping_networks).
# The command-line programs go to <prefix>/bin (mn_install_tools, called once examples/ is added).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(MN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/mapping_networks)

# The layer libraries (static) and the interface target over them.
install(TARGETS mapping_networks ${MN_LAYER_TARGETS}
  EXPORT mapping_networksTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Public headers only, in their layout (<prefix>/include/mapping_networks/core/tensor.h, ...), which is
# what the target's INSTALL_INTERFACE include directory expects: everything the umbrella header
# mapping/mapping_networks.h includes, and the headers of the parts it leaves out (dist/, nn/data/, ...).
# Internal headers stay in the source tree: the kernels' op tables and backends (kernels/ but for
# factories.h), the op implementations' helpers (autograd/functions/), core's hooks for the autograd
# layer, and dist's transports and backend classes (reached through dist/process_group.h).
# Directories are read at install time, so a public header added later needs no re-configure.
foreach(dir core autograd nn mapping dist)
  if(IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${dir})
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/${dir}
      DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mapping_networks
      FILES_MATCHING PATTERN "*.h"
      REGEX "/autograd/functions$" EXCLUDE
      REGEX "/core/tensor_hooks\\.h$" EXCLUDE
      REGEX "/dist/(gloo_process_group|gloo_store_adapter|mpi_process_group|nccl_process_group|socket|store_protocol|tcp_store_server)\.h$" EXCLUDE)
  endif()
endforeach()
install(FILES ${PROJECT_SOURCE_DIR}/kernels/factories.h
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/mapping_networks/kernels)

install(EXPORT mapping_networksTargets
  NAMESPACE mn::
  DESTINATION ${MN_INSTALL_CMAKEDIR})

# The config file re-finds the dependencies the exported target names (see the .in template).
get_target_property(_mn_library_type mn_core TYPE)
if(_mn_library_type STREQUAL "STATIC_LIBRARY")
  set(MN_INSTALL_STATIC ON)
else()
  set(MN_INSTALL_STATIC OFF)
endif()
configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/mapping_networksConfig.cmake.in
  ${PROJECT_BINARY_DIR}/mapping_networksConfig.cmake
  INSTALL_DESTINATION ${MN_INSTALL_CMAKEDIR})
# The API is still moving: only the same minor version is compatible while the major version is 0.
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/mapping_networksConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/mapping_networksConfig.cmake
  ${PROJECT_BINARY_DIR}/mapping_networksConfigVersion.cmake
  ${CMAKE_CURRENT_LIST_DIR}/mn_find_nccl.cmake
  DESTINATION ${MN_INSTALL_CMAKEDIR})

# The command-line programs, by target name: the ones of this list that the build has (the demo under
# either spelling, mn-paper once it exists). Sets MN_INSTALLED_TOOLS to what it installs (the install
# test checks them). They link the CUDA and NCCL libraries from where this build found them, so their
# run path keeps those directories (INSTALL_RPATH_USE_LINK_PATH): a program installed on this machine
# runs without LD_LIBRARY_PATH.
set(MN_TOOL_TARGETS mn-train mn-run mn-strategies mn-demo mn-paper)
macro(mn_install_tools)
  set(MN_INSTALLED_TOOLS)
  foreach(tool ${MN_TOOL_TARGETS})
    if(TARGET ${tool})
      list(APPEND MN_INSTALLED_TOOLS ${tool})
    endif()
  endforeach()
  if(MN_INSTALLED_TOOLS)
    set_target_properties(${MN_INSTALLED_TOOLS} PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
    install(TARGETS ${MN_INSTALLED_TOOLS} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()
endmacro()
