# SIMD settings for the fused backend (included by the top-level CMakeLists
# right after the attn_core target is defined).
#
# The fused kernels are written once with Highway and compiled for several
# instruction sets (foreach_target.h); the best one the CPU supports is picked
# at run time (HWY_DYNAMIC_DISPATCH): AVX-512, AVX2, SSE4 and a portable path.
# ATTN_FUSED_SOURCES lists the files compiled per target; a file added to it
# gets the two source properties below (it must also lie under src/kernels/,
# where the attn_core glob finds it).
find_package(hwy REQUIRED)
target_link_libraries(attn_core PRIVATE hwy::hwy)  # attnConfig.cmake finds hwy for static consumers

# The files compiled per target: fused.cpp includes the SIMD bodies
# (simd-inl.h, scores-inl.h, attention-inl.h, packed-inl.h) once per target, and so does the decode
# kernel (decode.cpp, which reuses simd-inl.h and adds vectors-inl.h and blocks-inl.h). tiles.cpp is compiled once,
# like the rest of src/.
set(ATTN_FUSED_SOURCES ${PROJECT_SOURCE_DIR}/src/kernels/fused/fused.cpp
  ${PROJECT_SOURCE_DIR}/src/kernels/decode/decode.cpp)
# SSSE3 adds nothing over SSE4 for these kernels; skipping it saves a compile.
set_property(SOURCE ${ATTN_FUSED_SOURCES} APPEND PROPERTY COMPILE_DEFINITIONS
  "HWY_DISABLED_TARGETS=HWY_SSSE3")
# Highway code without optimisation runs 50-100x slower (every vector op is a
# call); keep the kernels optimised in Debug/sanitizer builds too, so the test
# suite stays fast there. Sanitizer instrumentation is unaffected.
set_property(SOURCE ${ATTN_FUSED_SOURCES} APPEND PROPERTY COMPILE_OPTIONS
  "$<$<CONFIG:Debug>:-O2>")
