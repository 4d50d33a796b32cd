// OpenMP threads that wait passively, unless the user says otherwise.
//
// GCC's OpenMP runtime (libgomp) lets a thread that reaches the end of a
// parallel region spin for about 300,000 iterations before it sleeps. On a
// machine whose cores are busy with other work that spinning takes the CPU
// from the very thread it waits for: `attn train` on 2 threads ran several
// times slower than on 1 (bench/oversubscribed.sh measures it). With
// OMP_WAIT_POLICY=passive a waiting thread sleeps at once.
//
// libgomp reads its environment once, in its own initialiser, which runs
// before main() and before any constructor of the program. The only code of
// an executable that runs earlier is its .preinit_array, and that is too
// early to change the environment (the C library sets `environ` from the
// original block after it). So the function below, when neither
// OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set, runs the program again
// (/proc/self/exe, same arguments) with OMP_WAIT_POLICY=passive added: one
// exec, a few milliseconds, before anything else happened. A value the user
// set, even an empty one, is left alone and costs nothing; if the exec fails
// the program carries on with libgomp's default. Tools that follow a process
// (valgrind, gdb) see the exec: set OMP_WAIT_POLICY to avoid it.
//
// Linked into the programs built here (object library attn_passive_wait):
// the attn tool, the examples and the benchmarks. A program of your own that
// links libattn sets the variable in its environment (README, "Threads").
//
// Decoding is the exception. A decode step is many short parallel regions
// back to back (projections, attention over the cache, the output
// projection, for every block), and waking a sleeping thread costs more than
// a whole step of a small model: on the 2-vCPU development VM a thread woke
// about 60 µs after the region that needed it began (an empty region took
// about 110 µs with passive waiting, under 1 µs with spinning), and
// `attn generate` at batch 1 took 0.23-0.25 ms per step with passive waiting
// against 0.03-0.04 ms with a short spin (docs/decode.md, "Threads between
// the regions of a decode step"). A program that runs decode loops defines
// attn_wait_policy (below) to choose a bounded spin for them instead: with
// GOMP_SPINCOUNT=10000 a waiting thread spins for well under a millisecond
// here, which bridges the gaps inside and between steps, and then sleeps,
// so on a busy machine it wastes at most that much per region.
#include <unistd.h>

#include <cstddef>
#include <cstring>

// The environment entry to add when the user set no policy, chosen by the
// program from its arguments (a weak symbol: programs that do not define it
// wait passively). It runs before the C library is initialised: no
// allocation, nothing but plain reads of argv.
extern "C" const char* attn_wait_policy(int argc, char** argv) __attribute__((weak));  // passive_wait.hpp

namespace {

bool is_set(char** envp, const char* name_eq) {
  const size_t n = std::strlen(name_eq);
  for (char** e = envp; *e != nullptr; ++e)
    if (std::strncmp(*e, name_eq, n) == 0) return true;
  return false;
}

void passive_wait_by_default(int argc, char** argv, char** envp) {
  if (envp == nullptr || is_set(envp, "OMP_WAIT_POLICY=") || is_set(envp, "GOMP_SPINCOUNT=")) return;
  // A static block: the C library is not initialised yet, so no malloc.
  constexpr size_t kMax = 4096;
  static char* env[kMax];
  static char passive[] = "OMP_WAIT_POLICY=passive";
  const char* chosen = attn_wait_policy ? attn_wait_policy(argc, argv) : nullptr;
  size_t n = 0;
  env[n++] = chosen ? const_cast<char*>(chosen) : passive;
  for (char** e = envp; *e != nullptr; ++e) {
    if (n + 1 >= kMax) return;  // an environment this large keeps libgomp's default
    env[n++] = *e;
  }
  env[n] = nullptr;
  execve("/proc/self/exe", argv, env);  // returns only when it failed
}

}  // namespace

__attribute__((section(".preinit_array"), used)) void (*const attn_passive_wait_preinit)(int, char**, char**) =
    passive_wait_by_default;
