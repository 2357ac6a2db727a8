#include "train/weights_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "core/safetensors.h"
#include "train/weight_files.h"

namespace dstrain {

HostBlocks::HostBlocks(const ParamLayout& layout) {
  for (int block = 0; block < layout.num_blocks(); ++block) {
    storage_.emplace_back(static_cast<size_t>(layout.block_numel(block)), 0.0f);
    tensors_.emplace_back(storage_.back().data(), DType::F32,
                          std::initializer_list<int64_t>{layout.block_numel(block)});
  }
}

HostBlocks::HostBlocks(const ParamLayout& layout, const std::vector<int>& blocks) {
  storage_.resize(static_cast<size_t>(layout.num_blocks()));
  tensors_.resize(static_cast<size_t>(layout.num_blocks()));
  for (int block : blocks) {
    std::vector<float>& storage = storage_.at(static_cast<size_t>(block));
    storage.assign(static_cast<size_t>(layout.block_numel(block)), 0.0f);
    tensors_[static_cast<size_t>(block)] =
        Tensor(storage.data(), DType::F32, {layout.block_numel(block)});
  }
}

namespace {

// Calls fn(whole tensor's spec, slice's spec) for each parameter of block `block` (the same
// index in both layouts).
template <typename Fn>
void for_each_param_pair(const ParamLayout& full, const ParamLayout& local, int block, Fn&& fn) {
  DSTRAIN_CHECK(full.whole() && full.params().size() == local.params().size())
      << "full layout (tp " << full.tp() << ", ep " << full.ep() << ") and tp " << local.tp()
      << ", ep " << local.ep() << " layout differ";
  for (int index : local.block_params(block)) {
    fn(full.params()[static_cast<size_t>(index)], local.params()[static_cast<size_t>(index)]);
  }
}

}  // namespace

void extract_block_slice(const ParamLayout& full, const ParamLayout& local, int tp_rank, int block,
                         const HostBlocks& from, const HostBlocks& to) {
  for_each_param_pair(full, local, block, [&](const ParamSpec& whole, const ParamSpec& slice) {
    extract_tp_slice(slice, tp_rank, ParamLayout::view(whole, from.block(block)).f32(),
                     ParamLayout::view(slice, to.block(block)).f32());
  });
}

void insert_block_slice(const ParamLayout& full, const ParamLayout& local, int tp_rank, int block,
                        const HostBlocks& from, const HostBlocks& to) {
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

// The name Hugging Face files use for `name`, or "" when they have none of the accepted forms:
// as is, GPT-2's with "transformer.", the LLaMA family's without "model." (a base model's).
std::string find_in_files(const WeightFiles& files, const std::string& name) {
  if (files.contains(name)) return name;
  if (files.contains("transformer." + name)) return "transformer." + name;
  if (name.starts_with("model.") && files.contains(name.substr(6))) return name.substr(6);
  return "";
}

// The layout's name of a file's tensor (the inverse of find_in_files).
std::string layout_name(const ParamLayout& layout, const std::string& name) {
  if (name.starts_with("transformer.")) return name.substr(12);
  if (!layout.contains(name) && layout.contains("model." + name)) return "model." + name;
  return name;
}

LoadedWeights read_tensors(const WeightFiles& files, const ParamLayout& layout,
                           const HostBlocks& blocks, const std::string& suffix) {
  LoadedWeights loaded;
  std::map<DType, uint64_t> bytes_of;
  for (const ParamSpec& spec : layout.params()) {
    const std::string name = find_in_files(files, spec.name + suffix);
    DSTRAIN_USER_CHECK(!name.empty()) << files.origin() << " has no tensor " << spec.name + suffix;
    const SafetensorsFile& file = files.file_of(name);
    const SafetensorsTensorInfo& info = file.info(name);
    DSTRAIN_USER_CHECK(info.shape == spec.file_shape)
        << file.path().string() << ": tensor " << name << " has shape " << info.shape_str()
        << " but the model needs "
        << SafetensorsTensorInfo{name, DType::F32, spec.file_shape}.shape_str()
        << "; check --model against the checkpoint's config.json";
    file.read_f32(name, ParamLayout::view(spec, blocks.block(spec.block)).f32(), spec.file_numel());
    ++loaded.tensors;
    loaded.bytes += info.nbytes;
    bytes_of[info.dtype] += info.nbytes;
  }
  loaded.files = files.num_files();
  uint64_t most = 0;
  for (const auto& [dtype, bytes] : bytes_of) {
    loaded.dtypes += (loaded.dtypes.empty() ? "" : " + ") + std::string(dtype_name(dtype));
    if (bytes > most) {
      most = bytes;
      loaded.dtype = dtype;
    }
  }
  return loaded;
}

// Buffers and copies a checkpoint may hold that are not parameters: GPT-2's attention masks,
// old Llama checkpoints' rotary frequencies, and a tied model's lm_head (the embedding).
bool is_ignored_buffer(const ParamLayout& layout, const std::string& name) {
  return name.ends_with("attn.bias") || name.ends_with("attn.masked_bias") ||
         name.ends_with("rotary_emb.inv_freq") ||
         (name == "lm_head.weight" && layout.tied_embedding());
}

}  // namespace

void save_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path) {
  SafetensorsWriter writer;
  add_tensors(writer, layout, params, "");
  writer.set_metadata("format", "pt");
  writer.write(path);
}

LoadedWeights load_weights(const ParamLayout& layout, const HostBlocks& params,
                           const std::string& path) {
  const WeightFiles files = WeightFiles::open(path);
  LoadedWeights loaded = read_tensors(files, layout, params, "");
  // A tensor the model does not have means another architecture: say so rather than
  // silently dropping weights.
  for (const std::string& name : files.names()) {
    const std::string own = layout_name(layout, name);
    if (layout.is_skipped_layer_tensor(own)) {
      ++loaded.skipped;
      continue;
    }
    DSTRAIN_USER_CHECK(layout.contains(own) || is_ignored_buffer(layout, own))
        << files.origin() << " holds tensor " << name
        << ", which a model of this config does not have";
  }
  return loaded;
}

bool load_master_weights(const ParamLayout& layout, const HostBlocks& params,
                         const std::string& optimizer_path) {
  const WeightFiles files = WeightFiles::open(optimizer_path);
  if (!files.contains(layout.params().front().name + ".master")) return false;
  read_tensors(files, layout, params, ".master");
  return true;
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
  const WeightFiles files = WeightFiles::open(path);
  read_tensors(files, layout, exp_avg, ".exp_avg");
  read_tensors(files, layout, exp_avg_sq, ".exp_avg_sq");
}

namespace {

// The shard of each tensor (in the order names() lists them: suffix-major, then layout order):
// a new shard whenever the next tensor would take the current one past max_shard_bytes.
std::vector<int> assign_shards(const ParamLayout& layout, size_t suffixes,
                               uint64_t max_shard_bytes, size_t element_bytes) {
  std::vector<int> shard;
  uint64_t used = 0;
  int current = 0;
  for (size_t s = 0; s < suffixes; ++s) {
    for (const ParamSpec& spec : layout.params()) {
      const uint64_t bytes = static_cast<uint64_t>(spec.file_numel()) * element_bytes;
      if (max_shard_bytes > 0 && used > 0 && used + bytes > max_shard_bytes) {
        ++current;
        used = 0;
      }
      used += bytes;
      shard.push_back(current);
    }
  }
  return shard;
}

std::string shard_name(const std::string& stem, int shard, int shards) {
  if (shards == 1) return stem + ".safetensors";
  char name[64];
  std::snprintf(name, sizeof name, "-%05d-of-%05d.safetensors", shard + 1, shards);
  return stem + name;
}

}  // namespace

TensorFileLayout tensor_file_layout(const ParamLayout& layout, const std::string& stem,
                                    const std::vector<std::string>& suffixes,
                                    const std::map<std::string, std::string>& metadata,
                                    uint64_t max_shard_bytes, DType dtype) {
  DSTRAIN_CHECK(dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16)
      << "tensor files of " << dtype_name(dtype);
  const std::vector<int> shard =
      assign_shards(layout, suffixes.size(), max_shard_bytes, dtype_size(dtype));
  const int shards = shard.empty() ? 1 : shard.back() + 1;
  std::vector<SafetensorsWriter> writers(static_cast<size_t>(shards));  // describe the files
  const size_t count = layout.params().size();
  for (size_t s = 0; s < suffixes.size(); ++s) {
    for (size_t p = 0; p < count; ++p) {
      const ParamSpec& spec = layout.params()[p];
      writers[shard[s * count + p]].describe(spec.name + suffixes[s], dtype, spec.file_shape);
    }
  }
  TensorFileLayout files;
  files.suffixes = suffixes;
  files.dtype = dtype;
  std::vector<std::map<std::string, uint64_t>> offsets;
  for (int f = 0; f < shards; ++f) {
    SafetensorsWriter& writer = writers[static_cast<size_t>(f)];
    for (const auto& [key, value] : metadata) writer.set_metadata(key, value);
    files.files.push_back({shard_name(stem, f, shards), writer.header_bytes(), writer.file_size()});
    offsets.emplace_back();
    for (const SafetensorsTensorInfo& info : writer.infos()) {
      offsets.back()[info.name] = files.files.back().header.size() + info.offset;
    }
  }
  for (size_t s = 0; s < suffixes.size(); ++s) {
    files.file_index.emplace_back();
    files.file_offset.emplace_back();
    for (size_t p = 0; p < count; ++p) {
      const int f = shard[s * count + p];
      files.file_index.back().push_back(f);
      files.file_offset.back().push_back(
          offsets[static_cast<size_t>(f)].at(layout.params()[p].name + suffixes[s]));
    }
  }
  return files;
}

namespace {
[[noreturn]] void io_error(const std::string& what, const std::string& path) {
  DSTRAIN_USER_ERROR() << what << " " << path << " failed: " << std::strerror(errno);
  std::abort();
}
}  // namespace

namespace {

void create_tensor_file(const std::string& path, const TensorFileLayout::File& file) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error("creating", path);
  const bool ok = ::pwrite(fd, file.header.data(), file.header.size(), 0) ==
                      static_cast<ssize_t>(file.header.size()) &&
                  ::ftruncate(fd, static_cast<off_t>(file.size)) == 0;
  const int saved = errno;
  ::close(fd);
  errno = saved;
  if (!ok) io_error("writing", path);
}

// Hugging Face's index of a sharded checkpoint: {"metadata": {"total_size"}, "weight_map"}.
std::string shard_index(const ParamLayout& layout, const TensorFileLayout& files) {
  nlohmann::json index;
  uint64_t total = 0;
  for (size_t s = 0; s < files.suffixes.size(); ++s) {
    for (size_t p = 0; p < layout.params().size(); ++p) {
      const ParamSpec& spec = layout.params()[p];
      index["weight_map"][spec.name + files.suffixes[s]] =
          files.files[static_cast<size_t>(files.file_index[s][p])].name;
      total += static_cast<uint64_t>(spec.file_numel()) * dtype_size(files.dtype);
    }
  }
  index["metadata"]["total_size"] = total;
  return index.dump(2) + "\n";
}

}  // namespace

void create_tensor_files(const std::string& dir, const ParamLayout& layout,
                         const TensorFileLayout& files) {
  WrittenRanges written;
  for (const TensorFileLayout::File& file : files.files) {
    create_tensor_file((std::filesystem::path(dir) / file.name).string(), file);
    written.add(file.name, 0, file.header);
  }
  if (files.files.size() > 1) {
    const std::string name = files.files[0].name;
    const std::string stem = name.substr(0, name.find('-'));
    const std::string index = shard_index(layout, files);
    write_file_atomic(std::filesystem::path(dir) / (stem + ".safetensors.index.json"), index);
    written.add_whole(stem + ".safetensors.index.json", index);
  }
  written.record(dir);
}

TensorFilePart::TensorFilePart(const std::string& dir, const ParamLayout& layout,
                               const TensorFileLayout& files)
    : dir_(dir), layout_(layout), files_(files) {
  DSTRAIN_CHECK(layout.whole()) << "a file's layout is the whole model's";
  for (const TensorFileLayout::File& file : files.files) {
    const std::string path = (std::filesystem::path(dir) / file.name).string();
    fds_.push_back(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
    if (fds_.back() < 0) io_error("opening", path);
  }
}

TensorFilePart::~TensorFilePart() {
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

void TensorFilePart::write(int suffix, int block, int64_t begin, Tensor values,
                           const TpSlices& source) {
  const ParamLayout& local = source.layout != nullptr ? *source.layout : layout_;
  DSTRAIN_CHECK(local.params().size() == layout_.params().size())
      << "the part's layout is not the file's model";
  const int64_t end = begin + values.numel();
  DSTRAIN_CHECK(values.dtype == DType::F32 || values.dtype == DType::BF16) << values.shape_str();
  const auto* data = static_cast<const char*>(values.data);
  const size_t width = dtype_size(values.dtype);
  for (int index : local.block_params(block)) {
    const ParamSpec& spec = local.params()[index];
    if (spec.tp_dim < 0 && !source.replicated) continue;
    // The part of this tensor's slice inside [begin, end).
    const int64_t first = std::max(begin, spec.offset);
    const int64_t last = std::min(end, spec.offset + spec.numel());
    if (first >= last) continue;
    const int file = files_.file_index[suffix][index];
    const uint64_t tensor_at = files_.file_offset[suffix][index];
    for_each_tp_run(spec, source.tp_rank, first - spec.offset, last - spec.offset,
                    [&](int64_t local_index, int64_t full_index, int64_t count) {
                      // Only the rows files hold: wte's padded vocabulary rows end the whole
                      // tensor.
                      count = std::min(count, spec.file_numel() - full_index);
                      if (count <= 0) return;
                      write_values(file, data + (spec.offset + local_index - begin) * width,
                                   values.dtype, count,
                                   tensor_at + static_cast<uint64_t>(full_index) *
                                                   dtype_size(files_.dtype));
                    });
  }
}

void TensorFilePart::write_values(int file, const void* data, DType dtype, int64_t count,
                                  uint64_t at) {
  if (files_.dtype == dtype) {
    write_bytes(file, static_cast<const char*>(data), static_cast<size_t>(count) * dtype_size(dtype),
                at);
    return;
  }
  // Converted in pieces: bf16 values widened (exactly) to fp32 files; fp32 values rounded to
  // 16-bit files (to nearest even, as the GPU's conversions).
  constexpr int64_t kPiece = 1 << 16;
  const size_t piece = static_cast<size_t>(std::min(count, kPiece));
  std::vector<uint16_t> bits(files_.dtype == DType::F32 ? 0 : piece);
  std::vector<float> wide(files_.dtype == DType::F32 ? piece : 0);
  const bool bf16 = files_.dtype == DType::BF16;
  const size_t out_width = dtype_size(files_.dtype);
  for (int64_t first = 0; first < count; first += kPiece) {
    const int64_t n = std::min(kPiece, count - first);
    for (int64_t i = 0; i < n; ++i) {
      const float value = dtype == DType::F32
                              ? static_cast<const float*>(data)[first + i]
                              : bf16_bits_to_fp32(static_cast<const uint16_t*>(data)[first + i]);
      if (files_.dtype == DType::F32) {
        wide[static_cast<size_t>(i)] = value;
      } else {
        bits[static_cast<size_t>(i)] = bf16 ? fp32_to_bf16_bits(value) : fp32_to_fp16_bits(value);
      }
    }
    const char* out = files_.dtype == DType::F32 ? reinterpret_cast<const char*>(wide.data())
                                                 : reinterpret_cast<const char*>(bits.data());
    write_bytes(file, out, static_cast<size_t>(n) * out_width,
                at + static_cast<uint64_t>(first) * out_width);
  }
}

void TensorFilePart::write_bytes(int file, const char* source, size_t bytes, uint64_t at) {
  size_t written = 0;
  while (written < bytes) {
    const ssize_t n = ::pwrite(fds_[static_cast<size_t>(file)], source + written,
                               bytes - written, static_cast<off_t>(at + written));
    if (n <= 0) io_error("writing", files_.files[static_cast<size_t>(file)].name + " in " + dir_);
    written += static_cast<size_t>(n);
  }
  written_.add(files_.files[static_cast<size_t>(file)].name, at, std::string_view(source, bytes));
}

void TensorFilePart::close() {
  for (size_t f = 0; f < fds_.size(); ++f) {
    if (fds_[f] < 0) continue;
    const bool ok = ::fsync(fds_[f]) == 0;
    const int saved = errno;
    ::close(fds_[f]);
    fds_[f] = -1;
    errno = saved;
    if (!ok) io_error("syncing", files_.files[f].name + " in " + dir_);
  }
  written_.record(dir_);
}

}  // namespace dstrain
