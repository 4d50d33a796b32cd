// The OpenMP wait policy of the programs built here (passive_wait.cpp says
// why and how). A program that runs decode loops defines attn_wait_policy to
// return kDecodeSpin for them; a null return (or no definition) keeps the
// passive default. It is called before the C library is initialised: it
// may only read its arguments.
#pragma once

// A waiting thread spins for 10000 rounds (well under a millisecond on the
// development VM), then sleeps.
inline constexpr char kDecodeSpin[] = "GOMP_SPINCOUNT=10000";

extern "C" const char* attn_wait_policy(int argc, char** argv);
