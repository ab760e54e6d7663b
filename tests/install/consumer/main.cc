// Uses ckpt as an installed package: saves a tensor, reads it back, steps a StagedAdamW.
// Exits 0 only when every value round-trips.
#include <cstdio>
#include <span>
#include <vector>

#include "ckpt/checkpoint_store.h"
#include "ckpt/optimizer/staged_adamw.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto store = ckpt::CheckpointStore::Open(argv[1], ckpt::StoreOptions{});
  if (!store.ok()) return std::puts(store.status().ToString().c_str()), 1;
  std::vector<float> w = {1, 2, 3, 4};
  auto txn = (*store)->BeginSave(1);
  if (!txn.ok()) return 1;
  absl::Status s = (*txn)->DeclareTensor({"w", ckpt::formats::DType::kF32, {4}});
  s.Update((*txn)->WritePiece("w", 0, 4, std::as_bytes(std::span(w))));
  s.Update((*txn)->Commit());
  if (!s.ok()) return std::puts(s.ToString().c_str()), 1;
  auto reader = (*store)->OpenLatest();
  std::vector<float> back(4);
  if (!reader.ok() ||
      !(*reader)->ReadRange("w", 0, 4, std::as_writable_bytes(std::span(back))).ok())
    return 1;
  if (back != w) return 1;

  ckpt::optimizer::StagedAdamWOptions o;
  o.params = {{"w", {4}, ckpt::formats::DType::kF32, 0}};
  o.groups = {ckpt::optimizer::ParamGroup{}};
  o.pieces = {{0, 0, 4}};
  auto opt = ckpt::optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(w)));
  if (!opt.ok()) return std::puts(opt.status().ToString().c_str()), 1;
  std::vector<float> grads = {1, 1, 1, 1}, params(4);
  ckpt::optimizer::StepArgs args{grads.data(), ckpt::formats::DType::kF32, 1.0f, params.data()};
  auto report = (*opt)->Step(args);
  if (!report.ok() || params[0] >= 1.0f) return 1;  // AdamW moved the weight down.
  std::puts("consumer OK");
  return 0;
}
