# Finds NCCL, which ships with the CUDA toolkit here but has no CMake package of its own, and makes
# the imported target NCCL::nccl for it. Used twice: by the build (cmake/mn_dependencies.cmake) and,
# installed next to the package config, by consumers of a library built with NCCL, so that the exported
# link interface names the target and each machine resolves it to its own libnccl.
# Expects find_package(CUDAToolkit) to have run: the toolkit's directories come first. Sets NCCL_FOUND.
if(NOT TARGET NCCL::nccl)
  find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}
               PATH_SUFFIXES lib64 lib)
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}
            PATH_SUFFIXES include)
  if(NCCL_LIBRARY)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY})
    # The header is for compiling against NCCL (the build); linking a consumer needs the library only.
    if(NCCL_INCLUDE_DIR)
      set_target_properties(NCCL::nccl PROPERTIES INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
    endif()
  endif()
endif()
if(TARGET NCCL::nccl)
  set(NCCL_FOUND TRUE)
else()
  set(NCCL_FOUND FALSE)
endif()
