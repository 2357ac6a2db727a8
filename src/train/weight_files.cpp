#include "train/weight_files.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";

// The shard files of an index, in the order they first appear in its weight_map, and the
// tensor -> file map.
std::map<std::string, std::string> read_weight_map(const fs::path& index) {
  std::ifstream file(index);
  DSTRAIN_USER_CHECK(file.good()) << "cannot read " << index.string();
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& error) {
    DSTRAIN_USER_ERROR() << index.string() << " is not valid JSON (" << error.what() << ")";
  }
  DSTRAIN_USER_CHECK(json.is_object() && json.contains("weight_map") &&
                     json["weight_map"].is_object())
      << index.string() << " has no \"weight_map\" object";
  std::map<std::string, std::string> map;
  for (const auto& [name, shard] : json["weight_map"].items()) {
    DSTRAIN_USER_CHECK(shard.is_string())
        << index.string() << ": the shard of " << name << " is not a file name";
    const std::string file_name = shard.get<std::string>();
    DSTRAIN_USER_CHECK(!file_name.empty() && file_name.find('/') == std::string::npos &&
                       file_name != "." && file_name != "..")
        << index.string() << ": shard \"" << file_name << "\" of " << name
        << " is not a file name next to the index";
    map[name] = file_name;
  }
  return map;
}

}  // namespace

const SafetensorsFile& WeightFiles::file_of(const std::string& name) const {
  auto it = where_.find(name);
  DSTRAIN_CHECK(it != where_.end()) << origin_ << " has no tensor " << name;
  return *files_[it->second];
}

WeightFiles WeightFiles::open(const fs::path& path) {
  fs::path target = path;
  if (fs::is_directory(path)) {
    target = fs::exists(path / kIndexName) ? path / kIndexName : path / "model.safetensors";
    DSTRAIN_USER_CHECK(fs::exists(target))
        << path.string() << " holds neither " << kIndexName << " nor model.safetensors";
  }
  WeightFiles files;
  files.origin_ = target.string();
  if (target.filename() != kIndexName) {
    files.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(target)));
    for (const std::string& name : files.files_[0]->names()) {
      files.where_[name] = 0;
      files.names_.push_back(name);
    }
    return files;
  }
  std::map<std::string, size_t> shard_index;
  for (const auto& [name, shard] : read_weight_map(target)) {
    auto [it, added] = shard_index.emplace(shard, files.files_.size());
    if (added) {
      files.files_.push_back(
          std::make_unique<SafetensorsFile>(SafetensorsFile::open(target.parent_path() / shard)));
    }
    const SafetensorsFile& file = *files.files_[it->second];
    DSTRAIN_USER_CHECK(file.contains(name))
        << target.string() << " maps " << name << " to " << shard << ", which has no such tensor";
    files.where_[name] = it->second;
    files.names_.push_back(name);
  }
  // A tensor in a shard but not in the index would be silently dropped: refuse it.
  for (const auto& file : files.files_) {
    for (const std::string& name : file->names()) {
      DSTRAIN_USER_CHECK(files.where_.count(name))
          << file->path().string() << " holds " << name << ", which " << target.string()
          << " does not list";
    }
  }
  return files;
}

}  // namespace dstrain
