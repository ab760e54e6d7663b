// ckpt-tool bench: a subcommand per benchmark (each in its bench_*.cc), one of which is required.
#include <utility>
#include <vector>

#include "cli/command.h"

namespace ckpt::cli {

Command AddBenchCommand(CLI::App& app) {
  CLI::App* bench =
      app.add_subcommand("bench", "Benchmarks against the bound measured in the same run");
  bench->require_subcommand(1);
  // In the order bench --help lists them.
  std::vector<Command> commands = {
      AddBenchIoCommand(*bench),      AddBenchSafetensorsCommand(*bench),
      AddBenchAdamwCommand(*bench),   AddBenchReshardCommand(*bench),
      AddBenchStartupCommand(*bench), AddBenchOverlapCommand(*bench),
      AddBenchMuonCommand(*bench),    AddBenchCkptCommand(*bench),
      AddBenchAsyncSaveCommand(*bench),
  };
  return [commands = std::move(commands)] { return RunParsed(commands); };
}

}  // namespace ckpt::cli
