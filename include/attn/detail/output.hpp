// attn/detail/output.hpp — how the library and the attn tool write output
// files (internal: not part of the documented API).
//
// Every output is written to a temporary file next to its destination, named
//   <destination>.attn-tmp.XXXXXX
// flushed to disk and renamed over the destination, so the destination holds
// either its old content or the complete new one. A new file gets the mode
// 0666 minus the umask; a file that is replaced keeps its mode.
//
// Temporaries never outlive the process on purpose: an error removes them
// (destructors and the writers' own error paths), and after
// remove_temporaries_on_signal() so do SIGINT, SIGTERM and SIGHUP (the
// handler unlinks every registered temporary, then dies of the signal). Only
// kill -9 (or a crash) can leave one behind: at most one per output being
// written at that moment, recognisable by its ".attn-tmp." infix, with the
// old destination intact.
//
// OutputTransaction makes the outputs of one command all-or-nothing:
//
//   OutputTransaction tx;
//   const std::string y = tx.add("y.npy", "--out");       // checks now
//   const std::string w = tx.add("w.npy", "--weights");   // before computing
//   ... compute ...
//   io::write_npy(y, ...); io::write_npy(w, ...);       // into temporaries
//   tx.commit();                                         // rename them all
//
// add() checks the destination at once (not a directory, its directory
// exists and a file can be created in it, no other output of the transaction
// is the same file) and returns the name to write to instead: every writer
// that ends in write_file_atomic (.npy, safetensors, PNG, CSV) writes such a
// name directly and leaves it for commit(). Nothing is renamed until every
// output has been written; destroying an uncommitted transaction removes its
// temporaries and leaves every destination as it was.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace attn::io::detail {

class OutputTransaction {
 public:
  OutputTransaction() = default;
  OutputTransaction(const OutputTransaction&) = delete;
  OutputTransaction& operator=(const OutputTransaction&) = delete;
  ~OutputTransaction();

  // Claims `path` (named `what` in messages, e.g. "--out") and returns the
  // temporary name the output is to be written to. Throws attn::FileError
  // when no file can be written at `path`, attn::InvalidArgument when another output of
  // this transaction is the same file.
  std::string add(const std::string& path, const std::string& what);
  // Claims `path` like add() but leaves writing it to someone else (a file
  // written in place as work goes on, such as a periodic checkpoint): only
  // the checks, and the path counts for the duplicate check.
  void check(const std::string& path, const std::string& what);
  // Renames every written temporary over its destination, in the order added.
  // Throws FileError when an output was never written.
  void commit();

 private:
  struct Output {
    std::string path, what, staged;  // staged empty: check() only
    bool done = false;
  };
  void claim(const std::string& path, const std::string& what);
  std::vector<Output> outputs_;
};

// Throws FileError (naming `what` and the path) unless a file can be created
// at `path` now; creates nothing that outlives the call.
void check_output_path(const std::string& path, const std::string& what);

// Installs handlers for SIGINT, SIGTERM and SIGHUP that remove every
// temporary file registered by the writers, then re-raise the signal with its
// default action (so the process still ends as killed by it). For programs,
// not for a library embedded in someone else's process (the attn tool calls it).
void remove_temporaries_on_signal();

}  // namespace attn::io::detail
