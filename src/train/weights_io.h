// Model weights and optimizer state as files. In memory: one full (unsharded) F32 host
// buffer per block, laid out by ParamLayout. On disk: safetensors with Hugging Face names and
// file shapes (the embedding holds the real vocabulary rows only).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "model/layout.h"
#include "train/checksums.h"

namespace dstrain {

// Full F32 host copies of every block (zeroed), or of some of them (the others empty tensors:
// a pipeline stage's blocks).
class HostBlocks {
 public:
  explicit HostBlocks(const ParamLayout& layout);
  HostBlocks(const ParamLayout& layout, const std::vector<int>& blocks);
  const std::vector<Tensor>& tensors() const { return tensors_; }
  Tensor block(int b) const { return tensors_.at(b); }

 private:
  std::vector<std::vector<float>> storage_;
  std::vector<Tensor> tensors_;
};

// Tensor parallelism: full host blocks (laid out by `full`, tp = 1: what load_checkpoint and
// init fill) -> tp rank `tp_rank`'s blocks (laid out by `local` = ParamLayout(config, tp)),
// and back. Only the tensors' elements are copied: the alignment gaps of `to` stay as they
// are (zero in fresh HostBlocks), and so do the slices of the other tp ranks in `to` for
// insert_host_blocks. REQUIRES: full.tp() == 1, both of the same config.
void slice_host_blocks(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                       const HostBlocks& from, const HostBlocks& to);
void insert_host_blocks(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                        const HostBlocks& from, const HostBlocks& to);
// The same for block `block` only.
void extract_block_slice(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                         int block, const HostBlocks& from, const HostBlocks& to);
void insert_block_slice(const ParamLayout& full, const ParamLayout& local, int tp_rank,
                        int block, const HostBlocks& from, const HostBlocks& to);

// model.safetensors (F32), written atomically.
void save_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path);
// Loads Hugging Face weights (train/weight_files.h: a model.safetensors, a sharded model's
// index, or a model directory): GPT-2's names with or without "transformer.", the LLaMA
// family's with or without "model."; attention-mask buffers, rotary inv_freq buffers and a
// tied model's lm_head.weight are ignored, and so are DeepSeek-V3's multi-token prediction
// layers (counted in `skipped`); F32/F16/BF16 on disk, converted. Throws UserError
// naming the tensor on a missing or unknown tensor or a shape mismatch.
// Returns what was read, for the run's first lines.
struct LoadedWeights {
  size_t tensors = 0;     // tensors read into the model
  uint64_t bytes = 0;     // their bytes on disk
  size_t files = 0;       // safetensors files (shards) they came from
  DType dtype = DType::F32;  // the dtype holding most of those bytes
  std::string dtypes;     // every dtype read, "BF16" or "F32 + BF16"
  // Tensors of layers dstrain does not train (ParamLayout::is_skipped_layer_tensor), not read.
  size_t skipped = 0;
};
LoadedWeights load_weights(const ParamLayout& layout, const HostBlocks& params,
                           const std::string& path);
// The fp32 master weights a checkpoint with 16-bit model weights keeps in its
// optimizer.safetensors ("<name>.master"); false when the file has none (fp32 weights).
bool load_master_weights(const ParamLayout& layout, const HostBlocks& params,
                         const std::string& optimizer_path);
// optimizer.safetensors: "<name>.exp_avg" and "<name>.exp_avg_sq".
void save_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path);
void load_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path);

// Where each tensor of a checkpoint's files lies, computed from the layout alone, so every rank
// can write its own part of the data in place, in parallel (pwrite). One file, or the shards of
// a Hugging Face sharded checkpoint (model-00001-of-00003.safetensors, ... with
// model.safetensors.index.json naming each tensor's file).
struct TensorFileLayout {
  struct File {
    std::string name;    // "model.safetensors", "model-00001-of-00002.safetensors"
    std::string header;  // the bytes in front of the data buffer
    uint64_t size = 0;
  };
  std::vector<File> files;
  std::vector<std::string> suffixes;  // "" (weights) or ".exp_avg", ".exp_avg_sq", ".master"
  DType dtype = DType::F32;           // of every tensor in the files (F32, F16 or BF16)
  // [s][p]: the file of tensor layout.params()[p] with suffix s, and where it starts in it.
  std::vector<std::vector<int>> file_index;
  std::vector<std::vector<uint64_t>> file_offset;
};
// model.safetensors: `stem` "model", suffixes {""}; optimizer.safetensors: "optimizer",
// {".exp_avg", ".exp_avg_sq"} (and ".master", the fp32 weights, when the model's file holds
// 16-bit ones). Tensors go to shards in layout order, a new shard whenever the next tensor
// would take the current one's data past max_shard_bytes (0: one file), as transformers'
// save_pretrained(max_shard_size) does. `dtype`: what the tensors are stored as (F32, or F16 /
// BF16 rounded to nearest even from the fp32 values written).
TensorFileLayout tensor_file_layout(const ParamLayout& layout, const std::string& stem,
                                    const std::vector<std::string>& suffixes,
                                    const std::map<std::string, std::string>& metadata = {},
                                    uint64_t max_shard_bytes = 0, DType dtype = DType::F32);
// Creates every file of `layout` in `dir` holding its header and size bytes (the data zero),
// fsynced; and with several shards, `stem`.safetensors.index.json. The headers' and the index's
// CRC-32 are recorded in `dir` (train/checksums.h).
void create_tensor_files(const std::string& dir, const ParamLayout& layout,
                         const TensorFileLayout& files);

// Whose values a rank hands to TensorFilePart::write: tp rank `tp_rank`'s slices, laid out by
// `layout` (ParamLayout(config, tp); null: the file's own layout, tp = 1). Replicated tensors
// hold the same values on every tp rank, so one tp rank writing them is enough:
// `replicated` false skips them (write only this rank's slices of the split tensors).
struct TpSlices {
  const ParamLayout* layout = nullptr;
  int tp_rank = 0;
  bool replicated = true;  // write the replicated tensors too
};

// The open files of a checkpoint a rank writes its part of. Throws UserError on I/O errors.
class TensorFilePart {
 public:
  // `layout`: the whole model's (tp = 1), the one `files` was made from; the files in `dir`.
  TensorFilePart(const std::string& dir, const ParamLayout& layout, const TensorFileLayout& files);
  ~TensorFilePart();
  TensorFilePart(const TensorFilePart&) = delete;
  TensorFilePart& operator=(const TensorFilePart&) = delete;
  // Writes F32 (or BF16, widened exactly) `values`, the flat range [begin, begin +
  // values.numel()) of block `block` in
  // `source`'s layout, with suffix index `suffix`: each element where its element of the whole
  // tensor lies in the file (only the rows files hold: not wte's padded vocabulary rows),
  // converted to the files' dtype.
  // Several parts (dp shards, tp ranks) write disjoint elements of one file in parallel.
  void write(int suffix, int block, int64_t begin, Tensor values, const TpSlices& source = {});
  void close();  // fsync and close; records the CRC-32 of what it wrote (train/checksums.h)

 private:
  // `count` values of `dtype` (F32 or BF16) at `data`, converted to the files' dtype.
  void write_values(int file, const void* data, DType dtype, int64_t count, uint64_t at);
  void write_bytes(int file, const char* data, size_t bytes, uint64_t at);

  std::string dir_;
  const ParamLayout& layout_;
  const TensorFileLayout& files_;
  std::vector<int> fds_;  // one per file, -1 once closed
  WrittenRanges written_;  // recorded in dir_ by close() (train/checksums.h)
};

}  // namespace dstrain
