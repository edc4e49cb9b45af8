# layering: the layer targets (CMakeLists.txt) keep their direction. An upward #include must fail to
# compile with a layer's own include directories, and no layer library may need a symbol that only a
# layer it may not use defines. See tests/layering/check_layers.sh. Included from tests/CMakeLists.txt.
set(mn_layer_specs)
foreach(layer core kernels autograd nn mapping dist)
  string(REPLACE ";" "," allowed "${MN_LAYER_BELOW_${layer}}")
  list(APPEND mn_layer_specs
    "${layer}|$<TARGET_FILE:mn_${layer}>|${allowed}|$<JOIN:$<TARGET_PROPERTY:mn_${layer},INCLUDE_DIRECTORIES>,:>")
endforeach()
add_test(NAME layering
  COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/check_layers.sh ${CMAKE_CXX_COMPILER} ${CMAKE_NM}
          ${CMAKE_CURRENT_BINARY_DIR}/layering ${mn_layer_specs})
set_tests_properties(layering PROPERTIES LABELS unit TIMEOUT 300)
