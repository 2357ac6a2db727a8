#include "train/weights_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

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

// Calls fn(whole tensor's spec, slice's spec) for each parameter of block `block` (the same
// index in both layouts).
template <typename Fn>
void for_each_param_pair(const ParamLayout& full, const ParamLayout& local, int block, Fn&& fn) {
  DSTRAIN_CHECK(full.tp() == 1 && full.params().size() == local.params().size())
      << "full layout (tp " << full.tp() << ") and tp " << local.tp() << " layout differ";
  for (int index : local.block_params(block)) {
    fn(full.params()[static_cast<size_t>(index)], local.params()[static_cast<size_t>(index)]);
  }
}

}  // namespace

void extract_block_slice(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                         int block, const HostBlocks& from, const HostBlocks& to) {
  for_each_param_pair(full, local, block, [&](const ParamSpec& whole, const ParamSpec& slice) {
    extract_tp_slice(slice, tp_rank, ParamLayout::view(whole, from.block(block)).f32(),
                     ParamLayout::view(slice, to.block(block)).f32());
  });
}

void insert_block_slice(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                        int block, const HostBlocks& from, const HostBlocks& to) {
  for_each_param_pair(full, local, block, [&](const ParamSpec& whole, const ParamSpec& slice) {
    insert_tp_slice(slice, tp_rank, ParamLayout::view(slice, from.block(block)).f32(),
                    ParamLayout::view(whole, to.block(block)).f32());
  });
}

void slice_host_blocks(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                       const HostBlocks& from, const HostBlocks& to) {
  for (int block = 0; block < local.num_blocks(); ++block) {
    extract_block_slice(full, local, tp_rank, block, from, to);
  }
}

void insert_host_blocks(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                        const HostBlocks& from, const HostBlocks& to) {
  for (int block = 0; block < local.num_blocks(); ++block) {
    insert_block_slice(full, local, tp_rank, block, from, to);
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

TensorFileLayout tensor_file_layout(const ParamLayout& layout,
                                    const std::vector<std::string>& suffixes,
                                    const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter writer;  // describes the file; the ranks write the data
  TensorFileLayout file;
  file.suffixes = suffixes;
  for (const std::string& suffix : suffixes) {
    for (const ParamSpec& spec : layout.params()) {
      writer.describe(spec.name + suffix, DType::F32, spec.file_shape);
    }
  }
  for (const auto& [key, value] : metadata) writer.set_metadata(key, value);
  file.header = writer.header_bytes();
  file.file_size = writer.file_size();
  const std::vector<SafetensorsTensorInfo> infos = writer.infos();
  const size_t count = layout.params().size();
  for (size_t s = 0; s < suffixes.size(); ++s) {
    file.file_offset.emplace_back();
    for (size_t p = 0; p < count; ++p) {
      file.file_offset.back().push_back(file.header.size() + infos[s * count + p].offset);
    }
  }
  return file;
}

namespace {
[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  DSTRAIN_USER_ERROR() << what << " " << path << " failed: " << std::strerror(errno);
  std::abort();
}
}  // namespace

void create_tensor_file(const std::string& path, const TensorFileLayout& file) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error("creating", path);
  const bool ok = ::pwrite(fd, file.header.data(), file.header.size(), 0) ==
                      static_cast<ssize_t>(file.header.size()) &&
                  ::ftruncate(fd, static_cast<off_t>(file.file_size)) == 0;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  if (!ok) io_error("writing", path);
}

TensorFilePart::TensorFilePart(const std::string& path, const ParamLayout& layout,
                               const TensorFileLayout& file)
    : path_(path), layout_(layout), file_(file) {
  DSTRAIN_CHECK(layout.tp() == 1) << "a file's layout is the whole model's";
  fd_ = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) io_error("opening", path);
}

TensorFilePart::~TensorFilePart() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorFilePart::write(int suffix, int block, int64_t begin, Tensor values,
                           const TpSlices& source) {
  const ParamLayout& local = source.layout != nullptr ? *source.layout : layout_;
  DSTRAIN_CHECK(local.params().size() == layout_.params().size())
      << "the part's layout is not the file's model";
  const int64_t end = begin + values.numel();
  const float* data = values.f32();
  for (int index : local.block_params(block)) {
    const ParamSpec& spec = local.params()[index];
    if (spec.tp_dim < 0 && !source.replicated) continue;
    // The part of this tensor's slice inside [begin, end).
    const int64_t first = std::max(begin, spec.offset);
    const int64_t last = std::min(end, spec.offset + spec.numel());
    if (first >= last) continue;
    const uint64_t tensor_at = file_.file_offset[suffix][index];
    for_each_tp_run(spec, source.tp_rank, first - spec.offset, last - spec.offset,
                    [&](int64_t local_index, int64_t full_index, int64_t count) {
      // Only the rows files hold: wte's padded vocabulary rows end the whole tensor.
      count = std::min(count, spec.file_numel() - full_index);
      if (count <= 0) return;
      write_bytes(data + (spec.offset + local_index - begin), count,
                  tensor_at + static_cast<uint64_t>(full_index) * sizeof(float));
    });
  }
}

void TensorFilePart::write_bytes(const float* data, int64_t count, uint64_t at) {
  const char* source = reinterpret_cast<const char*>(data);
  const size_t bytes = static_cast<size_t>(count) * sizeof(float);
  size_t written = 0;
  while (written < bytes) {
    const ssize_t n =
        ::pwrite(fd_, source + written, bytes - written, static_cast<off_t>(at + written));
    if (n <= 0) io_error("writing", path_);
    written += static_cast<size_t>(n);
  }
}

void TensorFilePart::close() {
  if (fd_ < 0) return;
  const bool ok = ::fsync(fd_) == 0;
  const int saved = errno;
  ::close(fd_);
  fd_ = -1;
  errno = saved;
  if (!ok) io_error("syncing", path_);
}

}  // namespace dstrain
