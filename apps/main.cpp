// attn — the command-line front end of libattn. Each subcommand lives in its
// own function (commands.hpp); this file maps errors to exit codes.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <new>

#include "attn/detail/output.hpp"
#include "commands.hpp"
#include "common.hpp"
#include "passive_wait.hpp"
#include "train.hpp"

namespace {

using namespace attn::cli;

// "attn" or "attn <the subcommand being parsed>".
std::string command_name(const CLI::App* app) {
  if (app->get_parent()) return "attn " + app->get_name();
  const auto subs = app->get_subcommands();
  return subs.empty() ? "attn" : "attn " + subs.front()->get_name();
}

// The arguments CLI11 could not place, in `app` or the subcommand that ran.
std::vector<std::string> unplaced(const CLI::App& app, const CLI::App*& where) {
  where = &app;
  for (const CLI::App* sub : app.get_subcommands()) {
    if (!sub->remaining().empty()) {
      where = sub;
      return sub->remaining();
    }
  }
  return app.remaining();
}

// A parse error as one "error: ..." line (docs/cli.md). An unknown command or
// option is named even when CLI11 noticed a missing required option first.
int report_parse_error(CLI::App& app, const CLI::ParseError& e) {
  const CLI::App* where = nullptr;
  const std::vector<std::string> extra = unplaced(app, where);
  if (!extra.empty() && dynamic_cast<const CLI::ExtrasError*>(&e) == nullptr) {
    const std::string& first = extra.front();
    if (where == &app && app.get_subcommands().empty() && first.rfind('-', 0) != 0) {
      std::string names;
      for (const CLI::App* sub : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + sub->get_name();
      fmt::print(stderr, "error: unknown command '{}' (commands: {}); run `attn --help`\n", first, names);
    } else {
      const std::string cmd = command_name(where);
      fmt::print(stderr, "error: {}: unknown {} '{}'; run `{} --help`\n", cmd,
                 first.rfind('-', 0) == 0 ? "option" : "argument", first, cmd);
    }
    return kUsage;
  }
  const int rc = app.exit(e);  // --help: prints help; anything else: the failure message below
  return rc == 0 ? kOk : kUsage;
}

std::string failure_message(const CLI::App* app, const CLI::Error& e) {
  const std::string cmd = command_name(app);
  return fmt::format("error: {}: {}\nRun `{} --help` for more information.\n", cmd, e.what(), cmd);
}

}  // namespace

// OpenMP's wait policy when the user set none (apps/passive_wait): `generate`
// runs a decode loop, whose short parallel regions follow each other within
// microseconds, so its threads spin briefly between them; every other
// command waits passively. The command is the first argument that is not
// an option (the tool has no options of its own that take a value).
extern "C" const char* attn_wait_policy(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return std::strcmp(argv[i], "generate") == 0 ? kDecodeSpin : nullptr;
  return nullptr;
}

int main(int argc, char** argv) {
  // A signal removes the temporary files of outputs being written.
  attn::io::detail::remove_temporaries_on_signal();
  CLI::App app{"attn: exact, fast self-attention on the CPU - compute, explain, measure, draw"};
  app.require_subcommand(1);
  app.failure_message(failure_message);
  app.footer(std::string("Run `attn <command> --help` for a command's options. `attn tour` walks through "
                         "everything in about a minute.\n") +
             kExitCodesHelp);
  add_sdpa(app);
  add_mha(app);
  add_explain(app);
  add_experiment(app);
  add_train(app);
  add_generate(app);
  add_heatmap(app);
  add_bench(app);
  add_tour(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return report_parse_error(app, e);
  } catch (const UsageError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kUsage;
  } catch (const Unavailable& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kUnavailable;
  } catch (const attn::FileError& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kFileError;
  } catch (const attn::nn::TrainingDiverged& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kDiverged;
  } catch (const attn::InvalidArgument& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return kBadInput;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "error: out of memory (an allocation failed; a smaller problem, fewer threads or a "
                       "machine with more memory may help)\n");
    return kOutOfMemory;
  } catch (const std::exception& e) {
    fmt::print(stderr, "internal error: {}\n", e.what());
    return kInternal;
  }
  return kOk;
}
