// ckpt-tool hf-reshard: rewrites a HuggingFace checkpoint (file or directory) through our reader
// and writer, as one file or as shards of at most --max-shard-size bytes. Tensors keep their
// names, dtypes, shapes and bytes; files other than the weights are not copied.
#include <algorithm>
#include <iostream>
#include <memory>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "ckpt/hf_checkpoint.h"
#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckpt::cli {

int RunHfReshard(const HfReshardArgs& args) {
  uint64_t max_shard = 0;
  if (!args.max_shard_size.empty()) {
    absl::StatusOr<uint64_t> parsed = ParseByteSize(args.max_shard_size);
    if (!parsed.ok()) return ReportError("hf-reshard", parsed.status());
    max_shard = *parsed;
  }
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> reader = HfCheckpointReader::Open(args.src);
  if (!reader.ok()) {
    ReportError("hf-reshard", reader.status());
    return absl::IsDataLoss(reader.status()) ? kExitDamage : kExitUsage;
  }
  // Whole tensors in memory, in file order of the source (by shard, then offset).
  std::vector<const HfTensor*> order;
  for (const HfTensor& t : (*reader)->tensors()) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const HfTensor* a, const HfTensor* b) {
    return std::tie(a->shard, a->file_offset) < std::tie(b->shard, b->file_offset);
  });
  uint64_t total = 0;
  for (const HfTensor* t : order) {
    total = t->byte_size > UINT64_MAX - total ? UINT64_MAX : total + t->byte_size;
  }
  absl::Status fits = CheckFitsInMemory(
      total, absl::StrCat("hf-reshard holds every tensor of ", args.src, " in memory; it"));
  if (!fits.ok()) return ReportError("hf-reshard", fits);
  std::vector<std::string> storage;
  storage.reserve(order.size());
  std::vector<HfTensorData> tensors;
  ProgressBar bar("read ", order.size(), !args.json);
  for (const HfTensor* t : order) {
    storage.emplace_back(t->byte_size, '\0');
    absl::Status s = (*reader)->ReadBytes(t->name, 0, t->numel,
                                          std::as_writable_bytes(std::span(storage.back())));
    if (!s.ok()) return ReportError("hf-reshard", s);
    tensors.push_back({t->name, t->dtype, t->shape, std::as_bytes(std::span(storage.back()))});
    bar.Update(tensors.size());
  }
  bar.Finish();
  absl::Status written = WriteHfCheckpoint(args.dst, tensors, {.max_shard_bytes = max_shard});
  if (!written.ok()) return ReportError("hf-reshard", written);
  absl::StatusOr<std::unique_ptr<HfCheckpointReader>> back = HfCheckpointReader::Open(args.dst);
  if (!back.ok()) return ReportError("hf-reshard: re-reading the output", back.status());
  if (args.json) {
    PrintJson({{"src", args.src},
               {"dst", args.dst},
               {"tensors", tensors.size()},
               {"files", (*back)->shard_metadata().size()},
               {"sharded", (*back)->sharded()}});
  } else {
    std::cout << "wrote " << tensors.size() << " tensors to " << args.dst << " in "
              << (*back)->shard_metadata().size() << " file(s)\n";
  }
  return kExitOk;
}

Command AddHfReshardCommand(CLI::App& app) {
  auto args = std::make_shared<HfReshardArgs>();
  CLI::App* cmd = app.add_subcommand("hf-reshard",
                                     "Rewrite a HuggingFace checkpoint as one file or as "
                                     "shards, through ckpt's reader and writer");
  cmd->add_option("src", args->src, ".safetensors file or HF model directory")->required();
  cmd->add_option("dst", args->dst, "Output directory (created if absent)")->required();
  cmd->add_option("--max-shard-size", args->max_shard_size,
                  "Shard the output at this many bytes, e.g. 5G");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  return WhenParsed(cmd, [args] { return RunHfReshard(*args); });
}

}  // namespace ckpt::cli
