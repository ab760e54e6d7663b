#include "demo/demo_model.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <numbers>
#include <span>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "ckpt/base/coding.h"
#include "ckpt/formats/float_convert.h"

namespace ckpt::demo {
namespace {

using formats::DType;
using formats::StDType;
using optimizer::MomentDType;
using optimizer::ParamSpec;
using optimizer::Piece;

// A fixed pseudo-random number in [-1, 1) for (a, b, c): splitmix64 over the three.
float Unit(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t x = a * 0x9e3779b97f4a7c15ull ^ b * 0xbf58476d1ce4e5b9ull ^ c * 0x94d049bb133111ebull;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(x >> 40) / static_cast<float>(1ull << 23) - 1.0f;
}

// Where each piece starts in the rank's slabs.
std::vector<uint64_t> SlabOffsets(const std::vector<Piece>& pieces) {
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (const Piece& p : pieces) {
    offsets.push_back(at);
    at += p.count;
  }
  return offsets;
}

uint64_t Total(const std::vector<Piece>& pieces) {
  uint64_t n = 0;
  for (const Piece& p : pieces) n += p.count;
  return n;
}

// The slabs of `opt` as bytes: master, exp_avg, exp_avg_sq (moments in their slab dtype).
std::array<std::span<const std::byte>, 3> SlabBytes(const optimizer::StagedAdamW& opt) {
  return {std::as_bytes(opt.master()), opt.exp_avg_bytes(), opt.exp_avg_sq_bytes()};
}

void AppendBytes(std::string* out, std::span<const std::byte> bytes) {
  out->append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

}  // namespace

double LrSchedule::At(int step) const {
  if (step <= warmup) return peak * step / std::max(1, warmup);
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / std::max(1, total - warmup));
  return min + (peak - min) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

std::string LrSchedule::Describe() const {
  return absl::StrFormat("linear warmup over %d steps to %.1e, cosine to %.1e at step %d", warmup,
                         peak, min, total);
}

std::string LrSchedule::Encode() const {
  return absl::StrFormat("warmup %d total %d peak %.17g min %.17g", warmup, total, peak, min);
}

absl::StatusOr<LrSchedule> LrSchedule::Decode(absl::string_view text) {
  const std::vector<absl::string_view> f = absl::StrSplit(text, ' ');
  LrSchedule s;
  if (f.size() != 8 || f[0] != "warmup" || f[2] != "total" || f[4] != "peak" || f[6] != "min" ||
      !absl::SimpleAtoi(f[1], &s.warmup) || !absl::SimpleAtoi(f[3], &s.total) ||
      !absl::SimpleAtod(f[5], &s.peak) || !absl::SimpleAtod(f[7], &s.min) || s.warmup < 0 ||
      s.total < s.warmup || !(s.peak >= s.min) || !(s.min >= 0)) {
    return absl::DataLossError(absl::StrCat("blob ", kScheduleBlob, " holds \"", text,
                                            "\", not a learning-rate schedule"));
  }
  return s;
}

absl::StatusOr<DemoModel> DemoModel::FromHf(const HfCheckpointReader& hf, int ranks,
                                            optimizer::EngineKind engine, MomentDType moments) {
  DemoModel m;
  m.engine_ = engine;
  m.moments_ = moments;
  for (const HfTensor& t : hf.tensors()) {
    if (t.dtype != StDType::kBF16 && t.dtype != StDType::kF16 && t.dtype != StDType::kF32) continue;
    if (t.numel == 0) continue;
    m.params_.push_back({t.name, t.shape, DType::kBF16, t.shape.size() >= 2 ? 0u : 1u});
    m.elements_ += t.numel;
  }
  if (m.params_.empty())
    return absl::InvalidArgumentError(absl::StrCat(hf.path(), " holds no floating tensor"));
  m.groups_ = {optimizer::ParamGroup{.lr = 3e-3, .weight_decay = 0.1},
               optimizer::ParamGroup{.lr = 3e-3, .weight_decay = 0.0}};
  // Small buckets, so that a small model still spans several and ranks cut tensors.
  optimizer::BucketOptions buckets;
  buckets.bucket_elems = std::max<uint64_t>(1, m.elements_ / 3);
  CKPT_ASSIGN_OR_RETURN(std::vector<optimizer::Bucket> b,
                        optimizer::BuildBuckets(m.params_, buckets, ranks));
  m.pieces_ = optimizer::RankPieces(b, ranks);
  return m;
}

uint64_t DemoModel::elements_of(int rank) const { return Total(pieces_[rank]); }

float DemoModel::Target(uint32_t param, uint64_t index) const {
  const float u = Unit(param, index, 0xbeef);
  return params_[param].group == 0 ? 0.05f * u : 1.0f + 0.1f * u;
}

absl::StatusOr<std::vector<uint16_t>> DemoModel::ReadHfWeights(const HfCheckpointReader& hf,
                                                               int rank) const {
  const std::vector<Piece>& pieces = pieces_[rank];
  std::vector<float> f32(Total(pieces));
  std::vector<HfCheckpointReader::F32Request> requests;
  const std::vector<uint64_t> offsets = SlabOffsets(pieces);
  for (size_t k = 0; k < pieces.size(); ++k) {
    requests.push_back({params_[pieces[k].param].name, pieces[k].begin, pieces[k].count,
                        std::span(f32).subspan(offsets[k], pieces[k].count)});
  }
  CKPT_RETURN_IF_ERROR(hf.ReadManyAsF32(requests));
  std::vector<uint16_t> bf16(f32.size());
  for (size_t i = 0; i < f32.size(); ++i) bf16[i] = formats::FloatToBf16(f32[i]);
  return bf16;
}

absl::StatusOr<std::unique_ptr<DemoRank>> DemoRank::Create(const DemoModel& model, int rank,
                                                           std::vector<uint16_t> weights,
                                                           CheckpointStore* store,
                                                           Coordinator* coordinator) {
  std::unique_ptr<DemoRank> r(new DemoRank);
  r->pieces_ = model.pieces(rank);
  r->weights_ = std::move(weights);
  r->grads_.resize(r->weights_.size());
  // A rank that owns only padding still has an (empty) optimizer: it takes part in every
  // collective of a save or a load.
  optimizer::StagedAdamWOptions o;
  o.params = model.params();
  o.groups = model.groups();
  o.pieces = r->pieces_;
  o.engine = model.engine();
  o.moment_dtype = model.moments();
  o.unit_bytes = 64 << 10;
  // The ranks share this machine's cores.
  o.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / model.ranks());
  CKPT_ASSIGN_OR_RETURN(r->opt_,
                        optimizer::StagedAdamW::Create(o, std::as_bytes(std::span(r->weights_))));
  if (store != nullptr) {
    CKPT_ASSIGN_OR_RETURN(r->ckpt_,
                          optimizer::Checkpointer::Create(r->opt_.get(), store, coordinator));
  }
  if (model.engine() == optimizer::EngineKind::kCuda && !r->weights_.empty()) {
    CKPT_ASSIGN_OR_RETURN(r->device_, NewDeviceStep(r->weights_.size()));
  }
  return r;
}

absl::StatusOr<double> DemoRank::Step(const DemoModel& model, int step, double lr) {
  for (size_t g = 0; g < opt_->groups().size(); ++g) {
    optimizer::ParamGroup group = opt_->groups()[g];
    group.lr = lr;
    CKPT_RETURN_IF_ERROR(opt_->SetGroup(g, group));
  }
  double loss = 0;
  size_t at = 0;
  for (const Piece& p : pieces_) {
    for (uint64_t j = 0; j < p.count; ++j, ++at) {
      const float w = formats::Bf16ToFloat(weights_[at]);
      const float d = w - model.Target(p.param, p.begin + j);
      grads_[at] = d + 0.01f * Unit(static_cast<uint64_t>(step), p.param, p.begin + j);
      loss += 0.5 * static_cast<double>(d) * d;
    }
  }
  optimizer::StepReport report;
  if (device_ != nullptr) {
    CKPT_ASSIGN_OR_RETURN(report, device_->Step(*opt_, grads_, weights_));
  } else {
    optimizer::StepArgs args;
    args.grads = grads_.data();
    args.grad_dtype = DType::kF32;
    args.params = weights_.data();
    args.check_finite = true;
    CKPT_ASSIGN_OR_RETURN(report, opt_->Step(args));
  }
  if (report.skipped) return absl::InternalError("non-finite gradients in the demo's loss");
  return loss;
}

absl::Status DemoRank::Save(uint64_t step, const optimizer::Blobs& blobs) {
  if (ckpt_ == nullptr) return absl::FailedPreconditionError("this rank has no store to save to");
  return ckpt_->Save(step, blobs);
}

absl::StatusOr<std::unique_ptr<optimizer::PendingSave>> DemoRank::SaveAsync(
    uint64_t step, const optimizer::Blobs& blobs) {
  if (ckpt_ == nullptr) return absl::FailedPreconditionError("this rank has no store to save to");
  return ckpt_->SaveAsync(step, blobs);
}

absl::StatusOr<optimizer::LoadReport> DemoRank::Load(optimizer::Blobs* blobs) {
  if (ckpt_ == nullptr) return absl::FailedPreconditionError("this rank has no store to load from");
  CKPT_ASSIGN_OR_RETURN(optimizer::LoadReport report, ckpt_->Load(std::nullopt, blobs));
  CKPT_RETURN_IF_ERROR(opt_->WriteModelWeights(weights_.data()));
  return report;
}

void DemoRank::AppendState(std::string* out) const {
  PutFixed64(out, weights_.size());
  PutFixed32(out, static_cast<uint32_t>(opt_->moment_bytes()));
  for (std::span<const std::byte> slab : SlabBytes(*opt_)) AppendBytes(out, slab);
  AppendBytes(out, std::as_bytes(std::span(weights_)));
  PutFixed32(out, static_cast<uint32_t>(opt_->groups().size()));
  for (const optimizer::ParamGroup& g : opt_->groups()) {
    PutFixed64(out, g.step);
    for (double v : {g.lr, g.beta1, g.beta2, g.eps, g.weight_decay})
      PutFixed64(out, std::bit_cast<uint64_t>(v));
  }
}

bool DemoRank::SameState(const DemoRank& other) const {
  if (pieces_ != other.pieces_) return false;
  std::string a, b;
  AppendState(&a);
  other.AppendState(&b);
  return a == b;
}

std::string DumpState(const std::vector<std::unique_ptr<DemoRank>>& ranks) {
  std::string out(kStateDumpMagic);
  PutFixed32(&out, static_cast<uint32_t>(ranks.size()));
  for (const std::unique_ptr<DemoRank>& rank : ranks) rank->AppendState(&out);
  return out;
}

absl::Status WriteSmallModel(const std::string& dir) {
  constexpr uint64_t kHidden = 64, kInter = 128, kVocab = 256, kLayers = 2;
  std::vector<std::pair<std::string, std::vector<uint64_t>>> shapes = {
      {"model.embed_tokens.weight", {kVocab, kHidden}}};
  for (uint64_t l = 0; l < kLayers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"})
      shapes.push_back({absl::StrCat(p, "self_attn.", proj, ".weight"), {kHidden, kHidden}});
    shapes.push_back({p + "mlp.gate_proj.weight", {kInter, kHidden}});
    shapes.push_back({p + "mlp.up_proj.weight", {kInter, kHidden}});
    shapes.push_back({p + "mlp.down_proj.weight", {kHidden, kInter}});
    shapes.push_back({p + "input_layernorm.weight", {kHidden}});
    shapes.push_back({p + "post_attention_layernorm.weight", {kHidden}});
  }
  shapes.push_back({"model.norm.weight", {kHidden}});
  shapes.push_back({"lm_head.weight", {kVocab, kHidden}});
  std::vector<std::vector<uint16_t>> data(shapes.size());
  std::vector<HfTensorData> tensors;
  for (size_t t = 0; t < shapes.size(); ++t) {
    uint64_t n = 1;
    for (uint64_t d : shapes[t].second) n *= d;
    for (uint64_t i = 0; i < n; ++i) {
      const float v = shapes[t].second.size() == 1 ? 1.0f : 0.035f * Unit(t, i, 0x1417);
      data[t].push_back(formats::FloatToBf16(v));
    }
    tensors.push_back(
        {shapes[t].first, StDType::kBF16, shapes[t].second, std::as_bytes(std::span(data[t]))});
  }
  return WriteHfCheckpoint(dir, tensors);
}

}  // namespace ckpt::demo
