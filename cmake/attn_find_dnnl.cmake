# oneDNN as the imported target attn_deps::dnnl: its header and library found
# by path (Debian: libdnnl-dev). Included by attn's CMakeLists.txt and by the
# installed attnConfig.cmake, whose consumers link it through a static
# libattn_core.
if(NOT TARGET attn_deps::dnnl)
  find_path(ATTN_DNNL_INCLUDE_DIR oneapi/dnnl/dnnl.h)
  find_library(ATTN_DNNL_LIBRARY dnnl)
  if(ATTN_DNNL_INCLUDE_DIR AND ATTN_DNNL_LIBRARY)
    add_library(attn_deps::dnnl UNKNOWN IMPORTED)
    set_target_properties(attn_deps::dnnl PROPERTIES IMPORTED_LOCATION "${ATTN_DNNL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${ATTN_DNNL_INCLUDE_DIR}")
  endif()
endif()
