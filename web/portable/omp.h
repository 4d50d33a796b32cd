/* OpenMP's run-time calls for the single-threaded WebAssembly build (web/):
   the browser runs attn on one thread, so every team has one member and the
   `#pragma omp` lines are ignored (-Wno-source-uses-openmp). */
#pragma once
static inline int omp_get_max_threads(void) { return 1; }
static inline int omp_get_num_procs(void) { return 1; }
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
