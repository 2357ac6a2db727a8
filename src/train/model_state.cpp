#include "train/model_state.h"

#include <cmath>
#include <cstring>

#include "core/safetensors.h"

namespace dstrain {

ModelState::ModelState(const ModelConfig& config, Allocator& allocator)
    : config_(config), layout_(config) {
  for (int block = 0; block < layout_.num_blocks(); ++block) {
    const size_t bytes = static_cast<size_t>(layout_.block_numel(block)) * sizeof(float);
    params_.push_back(allocator.allocate(MemCategory::Parameters, bytes));
    grads_.push_back(allocator.allocate(MemCategory::Gradients, bytes));
    exp_avg_.push_back(allocator.allocate(MemCategory::OptimizerState, bytes));
    exp_avg_sq_.push_back(allocator.allocate(MemCategory::OptimizerState, bytes));
    std::memset(params_.back().data(), 0, bytes);
    std::memset(grads_.back().data(), 0, bytes);
    std::memset(exp_avg_.back().data(), 0, bytes);
    std::memset(exp_avg_sq_.back().data(), 0, bytes);
  }
}

static Tensor flat_view(const Buffer& buffer, int64_t numel) {
  return buffer.view(DType::F32, {numel});
}

Tensor ModelState::params(int block) const {
  return flat_view(params_.at(block), layout_.block_numel(block));
}
Tensor ModelState::grads(int block) const {
  return flat_view(grads_.at(block), layout_.block_numel(block));
}
Tensor ModelState::exp_avg(int block) const {
  return flat_view(exp_avg_.at(block), layout_.block_numel(block));
}
Tensor ModelState::exp_avg_sq(int block) const {
  return flat_view(exp_avg_sq_.at(block), layout_.block_numel(block));
}

void ModelState::zero_grads() {
  for (const Buffer& buffer : grads_) std::memset(buffer.data(), 0, buffer.bytes());
}

double ModelState::optimizer_step(Backend& backend, const AdamWConfig& adam, double lr,
                                  int64_t step) {
  double squares = 0.0;
  for (int block = 0; block < num_blocks(); ++block) {
    squares += backend.sum_squares(grads(block), nullptr);
  }
  const double grad_norm = std::sqrt(squares);
  const float clip = clip_coefficient(grad_norm, adam.grad_clip);
  for (int block = 0; block < num_blocks(); ++block) {
    const FlatRange range{block, 0, layout_.block_numel(block)};
    adamw_update_range(backend, layout_, range, params(block), grads(block), exp_avg(block),
                       exp_avg_sq(block), Tensor(), adam, lr, step, clip, nullptr);
  }
  return grad_norm;
}

namespace {

// Adds each parameter of `flats` under "<name><suffix>" with its file shape.
void add_tensors(SafetensorsWriter& writer, const ParamLayout& layout,
                 const std::vector<Tensor>& flats, const std::string& suffix) {
  for (const ParamSpec& spec : layout.params()) {
    const float* data = ParamLayout::view(spec, flats[spec.block]).f32();
    writer.add(spec.name + suffix, DType::F32, spec.file_shape, data);
  }
}

// The name a Hugging Face file uses for `name`, or "" when it has none of the accepted forms.
std::string find_in_file(const SafetensorsFile& file, const std::string& name) {
  if (file.contains(name)) return name;
  if (file.contains("transformer." + name)) return "transformer." + name;
  return "";
}

void read_tensors(const SafetensorsFile& file, const ParamLayout& layout,
                  const std::vector<Tensor>& flats, const std::string& suffix) {
  for (const ParamSpec& spec : layout.params()) {
    const std::string name = find_in_file(file, spec.name + suffix);
    DSTRAIN_USER_CHECK(!name.empty()) << file.path().string() << " has no tensor "
                                      << spec.name + suffix;
    const SafetensorsTensorInfo& info = file.info(name);
    DSTRAIN_USER_CHECK(info.shape == spec.file_shape)
        << file.path().string() << ": tensor " << name << " has shape " << info.shape_str()
        << " but the model needs " << SafetensorsTensorInfo{name, DType::F32, spec.file_shape}.shape_str()
        << "; check --model against the checkpoint's config.json";
    file.read_f32(name, ParamLayout::view(spec, flats[spec.block]).f32(), spec.file_numel());
  }
}

bool is_ignored_buffer(const std::string& name) {
  return name.ends_with("attn.bias") || name.ends_with("attn.masked_bias") ||
         name == "lm_head.weight";
}

}  // namespace

void ModelState::save_weights(const std::string& path) const {
  std::vector<Tensor> flats;
  for (int block = 0; block < num_blocks(); ++block) flats.push_back(params(block));
  SafetensorsWriter writer;
  add_tensors(writer, layout_, flats, "");
  writer.set_metadata("format", "pt");
  writer.write(path);
}

void ModelState::load_weights(const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::vector<Tensor> flats;
  for (int block = 0; block < num_blocks(); ++block) {
    flats.push_back(params(block));
    std::memset(flats.back().data, 0, flats.back().nbytes());
  }
  read_tensors(file, layout_, flats, "");
  // A tensor the model does not have means a different architecture: say so rather than
  // silently dropping weights.
  for (const std::string& name : file.names()) {
    const std::string bare = name.starts_with("transformer.") ? name.substr(12) : name;
    DSTRAIN_USER_CHECK(layout_.contains(bare) || is_ignored_buffer(bare))
        << path << " holds tensor " << name << ", which a GPT-2 with this config does not have";
  }
}

void ModelState::save_optimizer(const std::string& path) const {
  std::vector<Tensor> m, v;
  for (int block = 0; block < num_blocks(); ++block) {
    m.push_back(exp_avg(block));
    v.push_back(exp_avg_sq(block));
  }
  SafetensorsWriter writer;
  add_tensors(writer, layout_, m, ".exp_avg");
  add_tensors(writer, layout_, v, ".exp_avg_sq");
  writer.write(path);
}

void ModelState::load_optimizer(const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::vector<Tensor> m, v;
  for (int block = 0; block < num_blocks(); ++block) {
    m.push_back(exp_avg(block));
    v.push_back(exp_avg_sq(block));
  }
  read_tensors(file, layout_, m, ".exp_avg");
  read_tensors(file, layout_, v, ".exp_avg_sq");
}

}  // namespace dstrain
