# SIMD settings for the fused backend (included by the top-level CMakeLists).
#
# The fused kernels are written once with Highway and compiled for several
# instruction sets (foreach_target.h); the best one the CPU supports is picked
# at run time (HWY_DYNAMIC_DISPATCH): AVX-512, AVX2, SSE4 and a portable path.
find_package(hwy REQUIRED)
target_link_libraries(attn PRIVATE $<BUILD_INTERFACE:hwy::hwy>)
if(NOT BUILD_SHARED_LIBS)
  target_link_libraries(attn INTERFACE $<INSTALL_INTERFACE:hwy>)
endif()

# The one file compiled per target: fused.cpp includes the SIMD bodies
# (simd-inl.h, attention-inl.h) once per target. tiles.cpp is compiled once,
# like the rest of src/.
set(ATTN_FUSED_SOURCES ${PROJECT_SOURCE_DIR}/src/kernels/fused/fused.cpp)
# SSSE3 adds nothing over SSE4 for these kernels; skipping it saves a compile.
set_property(SOURCE ${ATTN_FUSED_SOURCES} APPEND PROPERTY COMPILE_DEFINITIONS
  "HWY_DISABLED_TARGETS=HWY_SSSE3")
# Highway code without optimisation runs 50-100x slower (every vector op is a
# call); keep the kernels optimised in Debug/sanitizer builds too, so the test
# suite stays fast there. Sanitizer instrumentation is unaffected.
set_property(SOURCE ${ATTN_FUSED_SOURCES} APPEND PROPERTY COMPILE_OPTIONS
  "$<$<CONFIG:Debug>:-O2>")
