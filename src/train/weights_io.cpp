#include "train/weights_io.h"

#include "core/safetensors.h"

namespace dstrain {

HostBlocks::HostBlocks(const ParamLayout& layout) {
  for (int block = 0; block < layout.num_blocks(); ++block) {
    storage_.emplace_back(static_cast<size_t>(layout.block_numel(block)), 0.0f);
    tensors_.emplace_back(storage_.back().data(), DType::F32,
                          std::initializer_list<int64_t>{layout.block_numel(block)});
  }
}

namespace {

// Adds each parameter of `blocks` under "<name><suffix>" with its file shape.
void add_tensors(SafetensorsWriter& writer, const ParamLayout& layout, const HostBlocks& blocks,
                 const std::string& suffix) {
  for (const ParamSpec& spec : layout.params()) {
    const float* data = ParamLayout::view(spec, blocks.block(spec.block)).f32();
    writer.add(spec.name + suffix, DType::F32, spec.file_shape, data);
  }
}

// The name a Hugging Face file uses for `name`, or "" when it has none of the accepted forms.
std::string find_in_file(const SafetensorsFile& file, const std::string& name) {
  if (file.contains(name)) return name;
  if (file.contains("transformer." + name)) return "transformer." + name;
  return "";
}

void read_tensors(const SafetensorsFile& file, const ParamLayout& layout, const HostBlocks& blocks,
                  const std::string& suffix) {
  for (const ParamSpec& spec : layout.params()) {
    const std::string name = find_in_file(file, spec.name + suffix);
    DSTRAIN_USER_CHECK(!name.empty()) << file.path().string() << " has no tensor "
                                      << spec.name + suffix;
    const SafetensorsTensorInfo& info = file.info(name);
    DSTRAIN_USER_CHECK(info.shape == spec.file_shape)
        << file.path().string() << ": tensor " << name << " has shape " << info.shape_str()
        << " but the model needs "
        << SafetensorsTensorInfo{name, DType::F32, spec.file_shape}.shape_str()
        << "; check --model against the checkpoint's config.json";
    file.read_f32(name, ParamLayout::view(spec, blocks.block(spec.block)).f32(),
                  spec.file_numel());
  }
}

bool is_ignored_buffer(const std::string& name) {
  return name.ends_with("attn.bias") || name.ends_with("attn.masked_bias") ||
         name == "lm_head.weight";
}

}  // namespace

void save_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path) {
  SafetensorsWriter writer;
  add_tensors(writer, layout, params, "");
  writer.set_metadata("format", "pt");
  writer.write(path);
}

void load_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  read_tensors(file, layout, params, "");
  // A tensor the model does not have means another architecture: say so rather than
  // silently dropping weights.
  for (const std::string& name : file.names()) {
    const std::string bare = name.starts_with("transformer.") ? name.substr(12) : name;
    DSTRAIN_USER_CHECK(layout.contains(bare) || is_ignored_buffer(bare))
        << path << " holds tensor " << name << ", which a GPT-2 with this config does not have";
  }
}

void save_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path) {
  SafetensorsWriter writer;
  add_tensors(writer, layout, exp_avg, ".exp_avg");
  add_tensors(writer, layout, exp_avg_sq, ".exp_avg_sq");
  writer.write(path);
}

void load_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path) {
  const SafetensorsFile file = SafetensorsFile::open(path);
  read_tensors(file, layout, exp_avg, ".exp_avg");
  read_tensors(file, layout, exp_avg_sq, ".exp_avg_sq");
}

}  // namespace dstrain
