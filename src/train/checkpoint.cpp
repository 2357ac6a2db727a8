#include "train/checkpoint.h"

#include <cstdio>
#include <filesystem>

#include "core/fs.h"

namespace dstrain {

namespace fs = std::filesystem;

std::string step_dir_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%06lld", static_cast<long long>(step));
  return name;
}

const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    default: return "float32";
  }
}

namespace {

// The optimizer file's suffixes: the moments, and the fp32 masters beside 16-bit weights.
std::vector<std::string> optimizer_suffixes(const CheckpointFormat& format) {
  std::vector<std::string> suffixes = {".exp_avg", ".exp_avg_sq"};
  if (format.weights_dtype != DType::F32) suffixes.push_back(".master");
  return suffixes;
}

}  // namespace

CheckpointWriter::CheckpointWriter(LayoutsOnly, const std::string& out_dir, int64_t step,
                                   const ModelConfig& config, const CheckpointFormat& format)
    : out_dir_(out_dir),
      step_(step),
      config_(config),
      layout_(config),
      format_(format),
      weights_(tensor_file_layout(layout_, "model", {""}, {{"format", "pt"}},
                                  format.max_shard_bytes, format.weights_dtype)),
      optimizer_(tensor_file_layout(layout_, "optimizer", optimizer_suffixes(format))) {}

CheckpointWriter::CheckpointWriter(const std::string& out_dir, int64_t step,
                                   const ModelConfig& config, const CheckpointFormat& format,
                                   const std::string& staging_tag)
    : CheckpointWriter(LayoutsOnly{}, out_dir, step, config, format) {
  staging_ = std::make_unique<StagingDir>(fs::path(out_dir) / step_dir_name(step), staging_tag);
  staging_path_ = staging_->path().string();
  create_tensor_files(staging_path_, layout_, weights_);
  create_tensor_files(staging_path_, layout_, optimizer_);
}

std::unique_ptr<CheckpointWriter> CheckpointWriter::join(const std::string& out_dir, int64_t step,
                                                         const ModelConfig& config,
                                                         const CheckpointFormat& format,
                                                         const std::string& staging_tag) {
  std::unique_ptr<CheckpointWriter> writer(
      new CheckpointWriter(LayoutsOnly{}, out_dir, step, config, format));
  writer->staging_path_ =
      staging_path(fs::path(out_dir) / step_dir_name(step), staging_tag).string();
  DSTRAIN_USER_CHECK(fs::is_directory(writer->staging_path_))
      << "--out " << out_dir << ": this node cannot see " << writer->staging_path_
      << ", which node 0 created for the checkpoint of step " << step
      << "; put --out on storage every node shares (NFS and the like)";
  return writer;
}

CheckpointWriter::~CheckpointWriter() = default;

void CheckpointWriter::write_part(const Part& part) const {
  TensorFilePart weights(staging_path_, layout_, weights_);
  TensorFilePart optimizer(staging_path_, layout_, optimizer_);
  const TpSlices source{part.layout, part.tp_rank, part.replicated};
  for (int block = 0; block < layout_.num_blocks(); ++block) {
    if (part.params[block].empty()) continue;  // another pipeline stage's block
    weights.write(0, block, part.begin[block], part.params[block], source);
    optimizer.write(0, block, part.begin[block], part.exp_avg[block], source);
    optimizer.write(1, block, part.begin[block], part.exp_avg_sq[block], source);
    if (optimizer_.suffixes.size() > 2) {  // the fp32 masters beside 16-bit weights
      optimizer.write(2, block, part.begin[block], part.params[block], source);
    }
  }
  weights.close();
  optimizer.close();
}

std::string CheckpointWriter::finish(const nlohmann::json& trainer_state) {
  DSTRAIN_CHECK(staging_) << "finish() on a joined checkpoint writer";
  WrittenRanges written;  // this writer's files, beside what write_part's ranks recorded
  const auto write = [&](const std::string& name, const std::string& bytes) {
    write_file_atomic(staging_->path() / name, bytes);
    written.add_whole(name, bytes);
  };
  nlohmann::json config = config_.to_json();
  config["torch_dtype"] = torch_dtype_name(format_.weights_dtype);
  write("config.json", config.dump(2) + "\n");
  for (const auto& [source, name] : format_.extra_files) write(name, read_file(source));
  nlohmann::json trainer = trainer_state;
  trainer["step"] = step_;
  trainer["complete"] = true;
  write("trainer.json", trainer.dump(2) + "\n");
  written.record(staging_->path());
  write_checksums(staging_->path());
  staging_->commit();
  // A link, so that from_pretrained(OUT/latest), ls and cp follow it.
  replace_symlink_atomic(fs::path(out_dir_) / "latest", step_dir_name(step_));
  return (fs::path(out_dir_) / step_dir_name(step_)).string();
}

std::string latest_name(const fs::path& latest) {
  std::string name = fs::is_symlink(latest) ? fs::read_symlink(latest).string() : read_file(latest);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

CheckpointInfo open_checkpoint(const std::string& path) {
  fs::path dir(path);
  DSTRAIN_USER_CHECK(fs::is_directory(dir))
      << "--resume " << path << " is not a directory (give a run's --out directory or one of "
      << "its step-NNNNNN checkpoints)";
  const fs::path latest = dir / "latest";
  if (fs::is_symlink(latest) || (fs::exists(latest) && !fs::exists(dir / "trainer.json"))) {
    const std::string name = latest_name(latest);
    DSTRAIN_USER_CHECK(!name.empty() && name.find('/') == std::string::npos &&
                       fs::is_directory(dir / name))
        << (dir / "latest").string() << " names checkpoint '" << name
        << "', which does not exist";
    dir /= name;
  }
  const char* weights = fs::exists(dir / "model.safetensors.index.json")
                            ? "model.safetensors.index.json"
                            : "model.safetensors";
  for (const char* file : {weights, "optimizer.safetensors", "config.json", "trainer.json"}) {
    DSTRAIN_USER_CHECK(fs::is_regular_file(dir / file))
        << "checkpoint " << dir.string() << " is incomplete: " << file
        << " is missing (a half-written checkpoint? resume from an earlier step-NNNNNN)";
  }
  CheckpointInfo info;
  info.dir = dir.string();
  const std::string config_text = read_file(dir / "config.json");
  info.config = model_config_from_json(config_text, (dir / "config.json").string());
  try {
    info.trainer_state = nlohmann::json::parse(read_file(dir / "trainer.json"));
  } catch (const nlohmann::json::exception&) {
    DSTRAIN_USER_ERROR() << "checkpoint " << dir.string()
                         << " has a corrupt trainer.json (not valid JSON)";
  }
  const nlohmann::json& trainer = info.trainer_state;
  DSTRAIN_USER_CHECK(trainer.is_object() && trainer.value("complete", false) == true &&
                     trainer.contains("step") && trainer["step"].is_number_integer() &&
                     trainer["step"].get<int64_t>() >= 0)
      << "checkpoint " << dir.string() << " has an incomplete trainer.json";
  return info;
}

void load_checkpoint(const CheckpointInfo& info, const FullTrainingState& state) {
  const ParamLayout layout(info.config);
  const std::string optimizer = (fs::path(info.dir) / "optimizer.safetensors").string();
  // 16-bit weights: the run continues from the fp32 masters beside the moments.
  if (!load_master_weights(layout, state.params, optimizer)) {
    load_weights(layout, state.params, info.dir);  // model.safetensors, or its shards
  }
  load_optimizer(layout, state.exp_avg, state.exp_avg_sq, optimizer);
}

}  // namespace dstrain
