// Trains a small transformer on a synthetic task: the same flags and output
// as `attn train` (apps/train.cpp), as a stand-alone program. Run with --help.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>

#include "train.hpp"

int main(int argc, char** argv) {
  attn::cli::TrainOpts o;
  CLI::App app{"Train a small transformer on a synthetic task (copy, reverse, sort, recall)."};
  attn::cli::add_train_flags(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help, or a usage error such as an unknown --task
  }
  try {
    attn::cli::run_train(o);
  } catch (const attn::Error& e) {
    std::cerr << "train: " << e.what() << '\n';
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "train: " << e.what() << '\n';
    return 1;
  }
  return 0;
}
