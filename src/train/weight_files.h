// The safetensors files of a Hugging Face model: one model.safetensors, or shards listed by
// model.safetensors.index.json (its weight_map: tensor name -> shard file). Opened one by one
// (each file is mapped, not read into memory), so loading a sharded 7B model never holds a
// second copy of it.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace dstrain {

class WeightFiles {
 public:
  // `path`: a .safetensors file, a model.safetensors.index.json, or a directory holding either
  // (the index first). Throws UserError with one sentence naming what is missing or broken.
  static WeightFiles open(const std::filesystem::path& path);

  // Every tensor name in the files.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // The file holding `name` (REQUIRES: contains(name)).
  const SafetensorsFile& file_of(const std::string& name) const;
  const std::string& origin() const { return origin_; }  // for messages
  size_t num_files() const { return files_.size(); }

 private:
  std::string origin_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // name -> index in files_
  std::vector<std::string> names_;
};

}  // namespace dstrain
