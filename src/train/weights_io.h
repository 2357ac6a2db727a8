// Model weights and optimizer state as files. In memory: one full (unsharded) F32 host
// buffer per block, laid out by ParamLayout. On disk: safetensors with Hugging Face GPT-2
// names and file shapes (wte.weight holds the real vocabulary rows only).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/layout.h"

namespace dstrain {

// Full F32 host copies of every block (zeroed).
class HostBlocks {
 public:
  explicit HostBlocks(const ParamLayout& layout);
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
// Loads a Hugging Face GPT-2 model.safetensors: names with or without the "transformer."
// prefix; attn.bias / attn.masked_bias buffers and lm_head.weight (tied) are ignored;
// F32/F16/BF16 accepted. Throws UserError on a missing or unknown tensor or a shape mismatch.
void load_weights(const ParamLayout& layout, const HostBlocks& params, const std::string& path);
// optimizer.safetensors: "<name>.exp_avg" and "<name>.exp_avg_sq".
void save_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path);
void load_optimizer(const ParamLayout& layout, const HostBlocks& exp_avg,
                    const HostBlocks& exp_avg_sq, const std::string& path);

// Where each tensor of a checkpoint file lies, computed from the layout alone, so every rank
// can write its own part of the data in place, in parallel (pwrite), into one file.
struct TensorFileLayout {
  std::string header;                  // the bytes in front of the data buffer
  uint64_t file_size = 0;
  std::vector<std::string> suffixes;   // "" (weights) or ".exp_avg", ".exp_avg_sq"
  // file_offset[s][p]: where tensor layout.params()[p] with suffix s starts in the file.
  std::vector<std::vector<uint64_t>> file_offset;
};
// model.safetensors: suffixes {""}; optimizer.safetensors: {".exp_avg", ".exp_avg_sq"}.
TensorFileLayout tensor_file_layout(const ParamLayout& layout,
                                    const std::vector<std::string>& suffixes,
                                    const std::map<std::string, std::string>& metadata = {});
// Creates `path` holding the header and file_size bytes (the data zero), fsynced.
void create_tensor_file(const std::string& path, const TensorFileLayout& file);

// Whose values a rank hands to TensorFilePart::write: tp rank `tp_rank`'s slices, laid out by
// `layout` (ParamLayout(config, tp); null: the file's own layout, tp = 1). Replicated tensors
// hold the same values on every tp rank, so one tp rank writing them is enough:
// `replicated` false skips them (write only this rank's slices of the split tensors).
struct TpSlices {
  const ParamLayout* layout = nullptr;
  int tp_rank = 0;
  bool replicated = true;  // write the replicated tensors too
};

// An open checkpoint file a rank writes its part of. Throws UserError on I/O errors.
class TensorFilePart {
 public:
  // `layout`: the whole model's (tp = 1), the one `file` was made from.
  TensorFilePart(const std::string& path, const ParamLayout& layout, const TensorFileLayout& file);
  ~TensorFilePart();
  TensorFilePart(const TensorFilePart&) = delete;
  TensorFilePart& operator=(const TensorFilePart&) = delete;
  // Writes F32 `values`, the flat range [begin, begin + values.numel()) of block `block` in
  // `source`'s layout, with suffix index `suffix`: each element where its element of the whole
  // tensor lies in the file (only the rows files hold: not wte's padded vocabulary rows).
  // Several parts (dp shards, tp ranks) write disjoint elements of one file in parallel.
  void write(int suffix, int block, int64_t begin, Tensor values, const TpSlices& source = {});
  void close();  // fsync and close

 private:
  void write_bytes(const float* data, int64_t count, uint64_t at);

  std::string path_;
  const ParamLayout& layout_;
  const TensorFileLayout& file_;
  int fd_ = -1;
};

}  // namespace dstrain
