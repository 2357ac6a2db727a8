// Checkpoints: OUT/step-NNNNNN/ is a Hugging Face model directory: model.safetensors (fp32, or
// bf16 / fp16 with --save-dtype; Hugging Face names and layouts; above --save-shard-size,
// shards with model.safetensors.index.json), config.json (its torch_dtype the weights'),
// the tokenizer files and generation_config.json the run was given, optimizer.safetensors
// (Adam moments, "<name>.exp_avg" and "<name>.exp_avg_sq", and with 16-bit weights the fp32
// master weights "<name>.master", which a resume continues from) and trainer.json (step, seed,
// data position, hyper-parameters), and checksums.json (every file's size and CRC-32, from the
// bytes as they were written: train/checksums.h).
// Each directory appears whole or not at all (filled under a temp name, fsynced, renamed);
// OUT/latest, a symbolic link to the newest one, is replaced atomically after it (runs of
// earlier versions wrote it as a text file naming the step; resume reads both).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/layout.h"
#include "train/weights_io.h"

namespace dstrain {

// The full training state a checkpoint holds (gathered from the ranks).
struct FullTrainingState {
  explicit FullTrainingState(const ParamLayout& layout)
      : params(layout), exp_avg(layout), exp_avg_sq(layout) {}
  HostBlocks params, exp_avg, exp_avg_sq;
};

// How a checkpoint is written: the weights' dtype and shard size, and the files copied beside
// them (so that AutoTokenizer and AutoModelForCausalLM load the directory as it is).
struct CheckpointFormat {
  uint64_t max_shard_bytes = 0;      // 0: one model.safetensors
  DType weights_dtype = DType::F32;  // F32, BF16 or F16
  // Copied into the checkpoint: (source path, file name there).
  std::vector<std::pair<std::string, std::string>> extra_files;
};

// The torch_dtype config.json names for `dtype` ("float32", "bfloat16", "float16").
const char* torch_dtype_name(DType dtype);

// A checkpoint being written by several ranks at once (each writes its own part of the same
// files): begin() on one rank, write_part() on every rank, finish() on the first again, with
// barriers between. The directory appears (renamed from its temp name) only in finish().
class CheckpointWriter {
 public:
  // Creates the staging directory and the tensor files at their full size: the weights in
  // one model.safetensors, or in shards of at most format.max_shard_bytes of data (0: no
  // limit) with model.safetensors.index.json, as transformers writes them.
  // staging_tag: names the staging directory (fs.h's StagingDir; "": this process's pid).
  CheckpointWriter(const std::string& out_dir, int64_t step, const ModelConfig& config,
                   const CheckpointFormat& format = {}, const std::string& staging_tag = "");
  // Several nodes on shared storage: another process's writer of the checkpoint that node 0's
  // writer (made with the same arguments and tag) staged, for write_part() only (no finish();
  // it never removes the directory). A staging directory this machine cannot see is a
  // UserError: --out must be on storage every node shares.
  static std::unique_ptr<CheckpointWriter> join(const std::string& out_dir, int64_t step,
                                                const ModelConfig& config,
                                                const CheckpointFormat& format,
                                                const std::string& staging_tag);
  ~CheckpointWriter();
  const ParamLayout& layout() const { return layout_; }  // the whole model's (tp = 1)
  // One rank's part: for each block, F32 master weights and Adam moments of the flat range
  // [begin, begin + numel) the tensors hold (empty tensors: a block another rank writes), in
  // tp rank `tp_rank`'s layout `layout` (null: layout(), tp = 1). `replicated`: also write
  // the replicated tensors (the same on every tp rank: one tp rank's parts write them, the
  // others pass false). Every element of the files must come from exactly one part.
  struct Part {
    std::vector<int64_t> begin;
    std::vector<Tensor> params, exp_avg, exp_avg_sq;
    const ParamLayout* layout = nullptr;
    int tp_rank = 0;
    bool replicated = true;
  };
  void write_part(const Part& part) const;
  // config.json, the extra files, trainer.json, the rename, OUT/latest. Returns the
  // checkpoint directory.
  std::string finish(const nlohmann::json& trainer_state);

 private:
  struct LayoutsOnly {};
  CheckpointWriter(LayoutsOnly, const std::string& out_dir, int64_t step,
                   const ModelConfig& config, const CheckpointFormat& format);

  std::string out_dir_;
  int64_t step_;
  ModelConfig config_;
  ParamLayout layout_;
  CheckpointFormat format_;
  TensorFileLayout weights_, optimizer_;
  std::unique_ptr<class StagingDir> staging_;  // null on a joined writer
  std::string staging_path_;
};


struct CheckpointInfo {
  std::string dir;              // the step directory
  ModelConfig config;           // from its config.json
  nlohmann::json trainer_state; // its trainer.json
};

// `path` is a run directory (its `latest` is followed) or a step directory. Validates that the
// four files are there and that trainer.json and config.json parse; throws UserError with one
// sentence otherwise (e.g. a half-written directory).
CheckpointInfo open_checkpoint(const std::string& path);

// Loads the weights (the fp32 masters where the checkpoint keeps them beside 16-bit weights)
// and the optimizer state of `info` into `state`.
void load_checkpoint(const CheckpointInfo& info, const FullTrainingState& state);

std::string step_dir_name(int64_t step);  // "step-000100"

// The checkpoint name `latest` (a run directory's OUT/latest) gives: the link's target, or the
// text runs of earlier versions wrote, trailing spaces and newlines dropped.
std::string latest_name(const std::filesystem::path& latest);

}  // namespace dstrain
