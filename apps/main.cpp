// attn — the command-line front end of libattn. Each subcommand lives in its
// own function (commands.hpp); this file maps errors to exit codes.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <exception>

#include "commands.hpp"
#include "common.hpp"
#include "train.hpp"

int main(int argc, char** argv) {
  using namespace attn::cli;
  CLI::App app{"attn: exact, fast self-attention on the CPU - compute, explain, measure, draw"};
  app.require_subcommand(1);
  app.footer(std::string("Run `attn <command> --help` for a command's options. `attn tour` walks through "
                         "everything in about a minute.\n") +
             kExitCodesHelp);
  add_sdpa(app);
  add_mha(app);
  add_explain(app);
  add_experiment(app);
  add_train(app);
  add_heatmap(app);
  add_bench(app);
  add_tour(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help or the parse error
    return rc == 0 ? kOk : kUsage;
  } catch (const UsageError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kUsage;
  } catch (const Unavailable& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kUnavailable;
  } catch (const attn::FileError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kFileError;
  } catch (const attn::InvalidArgument& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kBadInput;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "error: out of memory\n");
    return kInternal;
  } catch (const std::exception& e) {
    fmt::print(stderr, "internal error: {}\n", e.what());
    return kInternal;
  }
  return kOk;
}
