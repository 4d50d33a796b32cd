# attn::dist — context-parallel attention over MPI (include/attn/dist.hpp,
# src/dist/). Optional: on when an MPI implementation is found (Debian:
# libopenmpi-dev, installed by scripts/install-deps.sh). The core library
# never depends on MPI; only attn_dist, its tests, the example, the
# benchmark and the CLI's --context-parallel link it.
set(MPI_CXX_SKIP_MPICXX ON)  # the C API only, from C++
find_package(MPI COMPONENTS CXX QUIET)
option(ATTN_DIST "Build attn::dist (context-parallel attention over MPI)" ${MPI_CXX_FOUND})
if(ATTN_DIST AND NOT MPI_CXX_FOUND)
  message(FATAL_ERROR "ATTN_DIST=ON but no MPI was found (install libopenmpi-dev: scripts/install-deps.sh)")
endif()
if(NOT ATTN_DIST)
  message(STATUS "attn::dist: off (ATTN_DIST=OFF or no MPI found); its tests are skipped")
  if(ATTN_BUILD_TESTS)
    enable_testing()
    # ctest lists it as "Skipped" in its summary (exit code 77).
    add_test(NAME dist_mpi_skipped COMMAND sh -c
             "echo 'attn::dist tests SKIPPED: built without MPI (install libopenmpi-dev and openmpi-bin: scripts/install-deps.sh, then reconfigure)'; exit 77")
    set_tests_properties(dist_mpi_skipped PROPERTIES SKIP_RETURN_CODE 77)
  endif()
  return()
endif()
message(STATUS "attn::dist: on (MPI ${MPI_CXX_VERSION}, ${MPIEXEC_EXECUTABLE})")

file(GLOB ATTN_DIST_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/dist/*.cpp)
add_library(attn_dist ${ATTN_DIST_SOURCES})
add_library(attn::dist ALIAS attn_dist)
set_target_properties(attn_dist PROPERTIES EXPORT_NAME dist VERSION ${PROJECT_VERSION} SOVERSION 0)
target_include_directories(attn_dist PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_link_libraries(attn_dist PUBLIC attn::core MPI::MPI_CXX PRIVATE $<BUILD_INTERFACE:attn_warnings> OpenMP::OpenMP_CXX)
target_compile_definitions(attn_dist INTERFACE ATTN_HAVE_DIST=1)

# mpirun as ctest runs it: root is allowed on the project's machines, and
# more ranks than cores are fine for tests.
set(ATTN_MPIEXEC ${MPIEXEC_EXECUTABLE} --allow-run-as-root --oversubscribe ${MPIEXEC_PREFLAGS})

if(ATTN_BUILD_APPS)
  add_executable(ring_example ${PROJECT_SOURCE_DIR}/examples/ring_example.cpp)
  target_link_libraries(ring_example PRIVATE attn::dist attn_passive_wait attn_warnings)
endif()
if(ATTN_BUILD_BENCH)
  add_executable(ring-bench ${PROJECT_SOURCE_DIR}/bench/ring_bench.cpp)
  target_link_libraries(ring-bench PRIVATE attn::dist attn_passive_wait attn_warnings)
endif()
if(ATTN_BUILD_TESTS)
  # At the end of the top-level file, once the attn binary's target exists.
  cmake_language(DEFER DIRECTORY ${PROJECT_SOURCE_DIR} CALL include ${PROJECT_SOURCE_DIR}/tests/dist/CMakeLists.txt)
endif()
