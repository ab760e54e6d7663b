// ckpt-tool: inspect, verify, gc and benchmark checkpoint stores. The only place CLI11 appears;
// its exceptions stay here.
#include <malloc.h>

#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/command.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace {

// Names an unknown subcommand: CLI11 would only say that a subcommand is required.
bool UnknownSubcommand(CLI::App& app, int argc, char** argv, std::string* message) {
  CLI::App* level = &app;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.empty() || arg[0] == '-') return false;
    std::vector<std::string> known;
    for (CLI::App* sub : level->get_subcommands([](CLI::App*) { return true; }))
      known.push_back(sub->get_name());
    if (known.empty()) return false;
    bool found = false;
    for (CLI::App* sub : level->get_subcommands([](CLI::App*) { return true; })) {
      if (sub->get_name() == arg) {
        level = sub;
        found = true;
      }
    }
    if (!found) {
      *message =
          "unknown subcommand \"" + arg + "\" of " + level->get_name() + "; expected one of:";
      for (const std::string& k : known) *message += " " + k;
      return true;
    }
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  // Buffers of 1 MiB and more are mapped, and unmapped when freed. By default glibc raises this
  // threshold after the first such free (up to 32 MiB) and then keeps freed buffers in the
  // arena of the thread that held them: reshard's ranks, each a thread, would each keep their
  // write buffers, and the tool's peak memory would grow with --dp.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  using namespace ckpt::cli;
  CLI::App app{"ckpt-tool: inspect, verify and maintain ckpt checkpoint stores", "ckpt-tool"};
  app.require_subcommand(1);
  const CLI::Validator kStep = WholeNumber(0, UINT64_MAX);

  InspectArgs inspect;
  CLI::App* inspect_cmd =
      app.add_subcommand("inspect",
                         "Show a ckpt root (steps, LATEST, tensors, pieces, files, chunks, blobs) "
                         "or an HF checkpoint (tensors, shards)");
  inspect_cmd
      ->add_option("path", inspect.root, "ckpt root, .safetensors file or HF model directory")
      ->required();
  inspect_cmd->add_option("--step", inspect.step, "Show this step (default: the one LATEST names)")
      ->check(kStep);
  inspect_cmd->add_flag("--json", inspect.json, "Print one JSON object");

  VerifyArgs verify;
  CLI::App* verify_cmd = app.add_subcommand(
      "verify", "Re-read and check every chunk and manifest (exit 0 intact, 1 damaged, 2 usage)");
  verify_cmd->add_option("path", verify.root, "ckpt root, .safetensors file or HF model directory")
      ->required();
  CLI::Option* step_opt =
      verify_cmd->add_option("--step", verify.step, "Verify this step")->check(kStep);
  verify_cmd->add_flag("--all", verify.all, "Verify every step")->excludes(step_opt);
  verify_cmd->add_flag("--json", verify.json, "Print one JSON object");

  GcArgs gc;
  CLI::App* gc_cmd = app.add_subcommand("gc", "Delete old steps (never the one LATEST names)");
  gc_cmd->add_option("root", gc.root, "Checkpoint root directory")->required();
  gc_cmd->add_option("--keep-last", gc.keep_last, "Keep the newest K steps")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  gc_cmd->add_option("--keep-every", gc.keep_every, "Also keep steps that are multiples of N")
      ->check(WholeNumber(0, UINT64_MAX));
  gc_cmd->add_flag("--dry-run", gc.dry_run,
                   "Only print what recovery and retention would do (no LOCK, no change)");
  gc_cmd->add_flag("--purge-quarantine", gc.purge_quarantine,
                   "Also delete the steps recovery set aside in quarantine/");
  gc_cmd->add_flag("--json", gc.json, "Print one JSON object");

  AdoptArgs adopt;
  CLI::App* adopt_cmd = app.add_subcommand(
      "adopt", "Make LATEST name STEP once every chunk of it verifies (an unpublished step "
               "recovery kept, or an older one)");
  adopt_cmd->add_option("root", adopt.root, "Checkpoint root directory")->required();
  adopt_cmd->add_option("step", adopt.step, "The step")->required()->check(kStep);

  QuarantineArgs quarantine;
  uint64_t quarantine_step = 0;
  CLI::App* quarantine_cmd = app.add_subcommand(
      "quarantine", "Move a step (or, with --all, every step and LATEST) whole into quarantine/");
  quarantine_cmd->add_option("root", quarantine.root, "Checkpoint root directory")->required();
  CLI::Option* quarantine_step_opt =
      quarantine_cmd->add_option("step", quarantine_step, "The step")->check(kStep);
  quarantine_cmd
      ->add_flag("--all", quarantine.all, "Every step and LATEST: the root opens empty after")
      ->excludes(quarantine_step_opt);

  CLI::App* bench_cmd =
      app.add_subcommand("bench", "Benchmarks against the bound measured in the same run");
  bench_cmd->require_subcommand(1);
  BenchIoArgs bench_io;
  CLI::App* io_cmd = bench_cmd->add_subcommand(
      "io", "Save and load synthetic state; measure O_DIRECT write/read bounds");
  io_cmd->add_option("--dir", bench_io.dir, "Directory to benchmark in (must exist)")->required();
  io_cmd->add_option("--size", bench_io.size, "Bytes of state, e.g. 2G")->required();
  io_cmd->add_option("--ranks", bench_io.ranks, "Ranks, run as threads")
      ->check(WholeNumber(1, 256));
  io_cmd->add_option("--write-threads", bench_io.write_threads,
                     "Threads that copy, checksum and write the chunks of each rank's save")
      ->check(WholeNumber(1, 64));
  io_cmd->add_option("--zstd", bench_io.zstd_level, "Compress chunks with zstd at this level")
      ->check(WholeNumber(1, 19));
  io_cmd->add_flag("--keep", bench_io.keep, "Keep the committed checkpoint for inspection");
  io_cmd->add_flag("--json", bench_io.json, "Print one JSON object");

  BenchSafetensorsArgs bench_st;
  CLI::App* st_cmd = bench_cmd->add_subcommand(
      "safetensors",
      "Read every tensor of a safetensors file into FP32; measure the O_DIRECT read bound");
  st_cmd->add_option("--dir", bench_st.dir, "Directory to benchmark in (must exist)")->required();
  st_cmd->add_option("--size", bench_st.size, "File size, e.g. 2G")->required();
  st_cmd->add_option("--dtype", bench_st.dtype, "BF16, F16 or F32");
  st_cmd->add_option("--tensors", bench_st.tensors, "Number of tensors")
      ->check(WholeNumber(1, 100000));
  st_cmd->add_option("--threads", bench_st.threads, "Reader threads")->check(WholeNumber(1, 256));
  st_cmd
      ->add_option("--rounds", bench_st.rounds,
                   "Rounds of (bound, write, read); the median is reported")
      ->check(WholeNumber(1, 100));
  st_cmd->add_flag("--json", bench_st.json, "Print one JSON object");

  BenchAdamwArgs bench_adamw;
  CLI::App* adamw_cmd = bench_cmd->add_subcommand(
      "adamw", "StagedAdamW steps per second against host-memory or PCIe bounds");
  adamw_cmd->add_option("--params", bench_adamw.params, "Parameters (elements) on this rank")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  adamw_cmd->add_option("--threads", bench_adamw.threads, "CPU engine threads (0: every core)")
      ->check(WholeNumber(0, 1024));
  adamw_cmd->add_option("--engine", bench_adamw.engine, "cpu, cuda or both")
      ->check(CLI::IsMember({"cpu", "cuda", "both"}));
  adamw_cmd
      ->add_option("--grad-dtype", bench_adamw.grad_dtype, "CPU engine gradients: F32, BF16 or F16")
      ->check(CLI::IsMember({"F32", "BF16", "F16"}));
  adamw_cmd
      ->add_option("--caller-pages", bench_adamw.caller_pages,
                   "CPU engine: gradient/parameter buffers on huge or small pages")
      ->check(CLI::IsMember({"huge", "small"}));
  adamw_cmd
      ->add_option("--moments", bench_adamw.moments,
                   "CPU engine moments in the slabs: F32 (default) or BF16 (precision-aware)")
      ->check(CLI::IsMember({"F32", "BF16"}));
  adamw_cmd->add_flag("--check-finite", bench_adamw.check_finite,
                      "CPU engine: every step checks the gradients for NaN/Inf first");
  adamw_cmd->add_option("--steps", bench_adamw.steps, "Timed steps (best is reported)")
      ->check(WholeNumber(1, 1000));
  adamw_cmd->add_flag("--json", bench_adamw.json, "Print one JSON object");

  BenchReshardArgs bench_reshard;
  CLI::App* bench_reshard_cmd = bench_cmd->add_subcommand(
      "reshard", "Offline reshard of optimizer state against its O_DIRECT read + write bound");
  bench_reshard_cmd->add_option("--dir", bench_reshard.dir, "Directory to benchmark in (must exist)")
      ->required();
  bench_reshard_cmd->add_option("--params", bench_reshard.params, "Parameters (14 bytes of state each)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX / 16));
  bench_reshard_cmd->add_option("--ranks", bench_reshard.ranks, "Ranks that save the source")
      ->check(WholeNumber(1, 256));
  bench_reshard_cmd->add_option("--dp", bench_reshard.dp, "Ranks of the output")
      ->check(WholeNumber(1, 256));
  bench_reshard_cmd->add_flag("--json", bench_reshard.json, "Print one JSON object");

  BenchStartupArgs bench_startup;
  CLI::App* startup_cmd = bench_cmd->add_subcommand(
      "startup", "Building a StagedAdamW against the host's first-touch and pinning rates");
  startup_cmd->add_option("--params", bench_startup.params, "Parameters (BF16 weights)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX / 16));
  startup_cmd->add_option("--engine", bench_startup.engine, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  startup_cmd->add_flag("--json", bench_startup.json, "Print one JSON object");

  BenchOverlapArgs bench_overlap;
  CLI::App* overlap_cmd = bench_cmd->add_subcommand(
      "overlap",
      "An overlapped step behind a synthetic backward against the plain step and the bound");
  overlap_cmd->add_option("--params", bench_overlap.params, "Parameters (BF16 weights)")
      ->check(WholeNumber(1, UINT64_MAX / 32));
  overlap_cmd->add_option("--buckets", bench_overlap.buckets,
                          "Layers of the backward, each released when done (default 24)")
      ->check(WholeNumber(1, 100000));
  overlap_cmd->add_option("--backward-ms", bench_overlap.backward_ms,
                          "The whole synthetic backward in ms (default 50)")
      ->check(CLI::Range(0.001, 1e6));
  overlap_cmd->add_option("--engine", bench_overlap.engine, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  overlap_cmd->add_option("--moments", bench_overlap.moments, "F32 (default) or BF16")
      ->check(CLI::IsMember({"F32", "BF16"}));
  overlap_cmd->add_option("--threads", bench_overlap.threads, "CPU engine threads (0: every core)")
      ->check(WholeNumber(0, 1024));
  overlap_cmd->add_option("--unit-bytes", bench_overlap.unit_bytes,
                          "The optimizer's unit (0: its default, 8 MiB)")
      ->check(WholeNumber(0, uint64_t{1} << 40));
  overlap_cmd->add_option("--steps", bench_overlap.steps, "Timed steps of each kind (best is reported)")
      ->check(WholeNumber(1, 1000));
  overlap_cmd->add_flag("--clip-fires", bench_overlap.clip_fires,
                        "Finish with another scale than the speculation's: the step is redone");
  overlap_cmd->add_flag("--gate", bench_overlap.gate,
                        "Gate the overlapped step (CUDA engine): a window of units during "
                        "backward, the rest at Finish, then every unit awaited");
  overlap_cmd->add_option("--window", bench_overlap.window,
                          "With --gate: units on the device at once during backward (default 8)")
      ->check(WholeNumber(1, 1 << 20));
  overlap_cmd->add_flag("--json", bench_overlap.json, "Print one JSON object");

  BenchMuonArgs bench_muon;
  CLI::App* muon_cmd = bench_cmd->add_subcommand(
      "muon", "Muon steps against the Newton-Schulz products alone and host memory bandwidth");
  muon_cmd->add_option("--rows", bench_muon.rows, "Rows of each matrix (default 1024)")
      ->check(WholeNumber(1, 1 << 20));
  muon_cmd->add_option("--cols", bench_muon.cols, "Columns of each matrix (default 4096)")
      ->check(WholeNumber(1, 1 << 20));
  muon_cmd->add_option("--matrices", bench_muon.matrices, "Matrices in the group (default 8)")
      ->check(WholeNumber(1, 100000));
  muon_cmd->add_option("--threads", bench_muon.threads, "CPU engine threads (0: every core)")
      ->check(WholeNumber(0, 1024));
  muon_cmd->add_option("--steps", bench_muon.steps, "Timed steps (best is reported)")
      ->check(WholeNumber(1, 1000));
  muon_cmd->add_option("--engine", bench_muon.engine, "cpu or cuda (default cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  muon_cmd->add_flag("--json", bench_muon.json, "Print one JSON object");

  BenchCkptArgs bench_ckpt;
  CLI::App* ckpt_cmd = bench_cmd->add_subcommand(
      "ckpt", "Save and load optimizer state through Checkpointer against O_DIRECT bounds");
  ckpt_cmd->add_option("--dir", bench_ckpt.dir, "Directory to benchmark in (must exist)")
      ->required();
  ckpt_cmd->add_option("--params", bench_ckpt.params, "Parameters (14 bytes of state each)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  ckpt_cmd->add_option("--ranks", bench_ckpt.ranks, "Ranks, run as threads")
      ->check(WholeNumber(1, 256));
  ckpt_cmd->add_option("--tensors", bench_ckpt.tensors,
                       "Parameters of about equal size the elements are split into")
      ->check(WholeNumber(1, 1u << 24));
  ckpt_cmd->add_flag("--json", bench_ckpt.json, "Print one JSON object");

  BenchAsyncSaveArgs bench_async;
  CLI::App* async_cmd = bench_cmd->add_subcommand(
      "async-save",
      "Checkpointer::SaveAsync with steps running, against a plain step, a sync save and the "
      "write and copy bounds");
  async_cmd->add_option("--dir", bench_async.dir, "Directory to benchmark in (must exist)")
      ->required();
  async_cmd->add_option("--params", bench_async.params, "Parameters (14 bytes of state each)")
      ->required()
      ->check(WholeNumber(1, UINT64_MAX));
  async_cmd->add_option("--engine", bench_async.engine, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  async_cmd->add_option("--staging", bench_async.staging,
                        "Staging pool for units a step changes before they are written, e.g. 1G");
  async_cmd->add_option("--steps", bench_async.steps, "Steps timed without a save (median)")
      ->check(WholeNumber(1, 1000));
  async_cmd->add_option("--rounds", bench_async.rounds,
                        "Rounds of a sync save then an async save (medians are reported)")
      ->check(WholeNumber(1, 100));
  async_cmd->add_option("--step-gap-ms", bench_async.step_gap_ms,
                        "Milliseconds between steps during the save, as a trainer's forward and "
                        "backward (default 0: back to back)")
      ->check(WholeNumber(0, 60000));
  async_cmd->add_option("--write-threads", bench_async.write_threads,
                        "Threads that copy, checksum and write the chunks of a save")
      ->check(WholeNumber(1, 64));
  async_cmd->add_flag("--json", bench_async.json, "Print one JSON object");

  DiffArgs diff;
  CLI::App* diff_cmd = app.add_subcommand(
      "diff",
      "Compare the tensors of two checkpoints (ckpt roots or HF paths): exit 0 equal, 1 differ");
  diff_cmd->add_option("a", diff.a, "ckpt root, .safetensors file or HF model directory")
      ->required();
  diff_cmd->add_option("b", diff.b, "ckpt root, .safetensors file or HF model directory")
      ->required();
  uint64_t diff_step = 0, diff_step_b = 0;
  CLI::Option* diff_step_opt = diff_cmd->add_option("--step", diff_step, "Step of A (default LATEST)")
                              ->check(WholeNumber(0, UINT64_MAX));
  CLI::Option* diff_step_b_opt =
      diff_cmd->add_option("--step-b", diff_step_b, "Step of B (default LATEST)")
          ->check(WholeNumber(0, UINT64_MAX));
  diff_cmd->add_option("--atol", diff.atol,
                       "Floating values within this absolute difference count as equal");
  diff_cmd->add_flag("--json", diff.json, "Print one JSON object");

  HfReshardArgs reshard;
  CLI::App* reshard_cmd = app.add_subcommand("hf-reshard",
                                             "Rewrite a HuggingFace checkpoint as one file or as "
                                             "shards, through ckpt's reader and writer");
  reshard_cmd->add_option("src", reshard.src, ".safetensors file or HF model directory")
      ->required();
  reshard_cmd->add_option("dst", reshard.dst, "Output directory (created if absent)")->required();
  reshard_cmd->add_option("--max-shard-size", reshard.max_shard_size,
                          "Shard the output at this many bytes, e.g. 5G");
  reshard_cmd->add_flag("--json", reshard.json, "Print one JSON object");

  ExportHfArgs export_hf;
  uint64_t export_step = 0;
  CLI::App* export_cmd = app.add_subcommand(
      "export-hf", "Write a committed step's model as HuggingFace safetensors (bounded memory)");
  export_cmd->add_option("root", export_hf.root, "Checkpoint root")->required();
  export_cmd->add_option("out", export_hf.out, "Output directory (created if absent)")->required();
  CLI::Option* export_step_opt =
      export_cmd->add_option("--step", export_step, "Step to export (default: LATEST)")
          ->check(WholeNumber(0, UINT64_MAX));
  export_cmd->add_option("--dtype", export_hf.dtype,
                         "BF16, F16 or F32 (default: each tensor's own dtype)");
  export_cmd->add_option("--from", export_hf.from,
                         "weights (the model-dtype weights) or masters (the FP32 masters)");
  export_cmd->add_option("--max-shard-size", export_hf.max_shard_size,
                         "Shard the output at this many bytes (default 5G)");
  export_cmd->add_option("--config", export_hf.config, "config.json to copy beside the weights");
  export_cmd->add_flag("--json", export_hf.json, "Print one JSON object");

  ReshardArgs dp_reshard;
  uint64_t dp_reshard_step = 0;
  int dp_reshard_zstd = 0;
  CLI::App* dp_reshard_cmd = app.add_subcommand(
      "reshard", "Rewrite a committed step for another data-parallel size, as a transaction into "
                 "DST (bounded memory)");
  dp_reshard_cmd->add_option("root", dp_reshard.root, "Checkpoint root")->required();
  dp_reshard_cmd->add_option("dst", dp_reshard.dst, "Output checkpoint root (created if absent)")
      ->required();
  dp_reshard_cmd->add_option("--dp", dp_reshard.dp, "Ranks of the output (1 to 1024)")
      ->required()
      ->check(WholeNumber(1, 1024));
  dp_reshard_cmd->add_option("--bucket-elems", dp_reshard.bucket_elems,
                             "The next job's bucket size in elements (default 40000000)")
      ->check(WholeNumber(1, UINT64_MAX));
  CLI::Option* dp_reshard_step_opt =
      dp_reshard_cmd->add_option("--step", dp_reshard_step, "Step to reshard (default: LATEST)")
          ->check(WholeNumber(0, UINT64_MAX));
  CLI::Option* dp_reshard_zstd_opt =
      dp_reshard_cmd->add_option("--zstd", dp_reshard_zstd,
                                 "Compress chunks with zstd at LEVEL (1 to 22)")
          ->check(WholeNumber(1, 22));
  dp_reshard_cmd->add_flag("--json", dp_reshard.json, "Print one JSON object");

  std::string unknown;
  if (UnknownSubcommand(app, argc, argv, &unknown)) {
    std::cerr << "ckpt-tool: " << Printable(unknown) << "\nRun with --help for more information.\n";
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? kExitOk : kExitUsage;
  }
  if (inspect_cmd->parsed()) return RunInspect(inspect);
  if (verify_cmd->parsed()) return RunVerify(verify);
  if (gc_cmd->parsed()) return RunGc(gc);
  if (adopt_cmd->parsed()) return RunAdopt(adopt);
  if (quarantine_cmd->parsed()) {
    if (quarantine_step_opt->count() > 0) quarantine.step = quarantine_step;
    if (!quarantine.step.has_value() && !quarantine.all) {
      std::cerr << "ckpt-tool quarantine: name a STEP or --all\n";
      return kExitUsage;
    }
    return RunQuarantine(quarantine);
  }
  if (io_cmd->parsed()) return RunBenchIo(bench_io);
  if (st_cmd->parsed()) return RunBenchSafetensors(bench_st);
  if (reshard_cmd->parsed()) return RunHfReshard(reshard);
  if (diff_cmd->parsed()) {
    if (diff_step_opt->count() > 0) diff.step = diff_step;
    if (diff_step_b_opt->count() > 0) diff.step_b = diff_step_b;
    return RunDiff(diff);
  }
  if (dp_reshard_cmd->parsed()) {
    if (dp_reshard_step_opt->count() > 0) dp_reshard.step = dp_reshard_step;
    if (dp_reshard_zstd_opt->count() > 0) dp_reshard.zstd_level = dp_reshard_zstd;
    return RunReshard(dp_reshard);
  }
  if (export_cmd->parsed()) {
    if (export_step_opt->count() > 0) export_hf.step = export_step;
    return RunExportHf(export_hf);
  }
  if (adamw_cmd->parsed()) return RunBenchAdamw(bench_adamw);
  if (ckpt_cmd->parsed()) return RunBenchCkpt(bench_ckpt);
  if (bench_reshard_cmd->parsed()) return RunBenchReshard(bench_reshard);
  if (startup_cmd->parsed()) return RunBenchStartup(bench_startup);
  if (overlap_cmd->parsed()) return RunBenchOverlap(bench_overlap);
  if (muon_cmd->parsed()) return RunBenchMuon(bench_muon);
  if (async_cmd->parsed()) return RunBenchAsyncSave(bench_async);
  std::cerr << app.help();
  return kExitUsage;
}
