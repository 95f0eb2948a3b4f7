// strata-bench: measures the machine and strata on it. Each subcommand prints a readable line,
// or one JSON object with --json.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "strata/base/error.h"

namespace strata::bench {
void register_alloc(CLI::App& app);
void register_copy(CLI::App& app);
void register_io(CLI::App& app);
void register_overlap(CLI::App& app);
void register_adam(CLI::App& app);
void register_dequant(CLI::App& app);
}  // namespace strata::bench

int main(int argc, char** argv) {
  CLI::App app{"strata-bench: allocator, copy-link and (later) io/overlap benchmarks"};
  app.require_subcommand(1);
  strata::bench::register_alloc(app);
  strata::bench::register_copy(app);
  strata::bench::register_io(app);
  strata::bench::register_overlap(app);
  strata::bench::register_adam(app);
  strata::bench::register_dequant(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const strata::Error& e) {
    std::fprintf(stderr, "strata-bench: error (%s): %s\n", strata::to_string(e.code()), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata-bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
