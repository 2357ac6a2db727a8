#include "data/prepare_util.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <regex>

#include "core/check.h"

namespace dstrain {

namespace fs = std::filesystem;

std::string shard_name(const char* split, size_t index, const char* extension) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s_%06zu%s", split, index, extension);
  return name;
}

TreeRemover::~TreeRemover() {
  std::error_code ignored;
  fs::remove_all(path, ignored);
}

fs::path make_staging_directory(const std::string& out_dir) {
  std::error_code error;
  fs::create_directories(out_dir, error);
  DSTRAIN_USER_CHECK(!error) << "cannot create the output directory '" << out_dir
                             << "': " << error.message() << ".";
  // Inside out_dir (same file system): the shards are moved out only when all are complete,
  // so a failure leaves out_dir as it was.
  const fs::path staging = fs::path(out_dir) / (".prepare-tmp-" + std::to_string(::getpid()));
  fs::remove_all(staging, error);  // a leftover of a crashed run with our pid
  fs::create_directory(staging, error);
  DSTRAIN_USER_CHECK(!error) << "cannot create the directory '" << staging.string()
                             << "': " << error.message() << ".";
  return staging;
}

Spool::Spool(const fs::path& path, size_t width)
    : path_(path.string()), width_(width), file_(std::fopen(path_.c_str(), "w+b")) {
  DSTRAIN_USER_CHECK(file_ != nullptr)
      << "cannot create the scratch file '" << path_ << "': " << std::strerror(errno) << ".";
}

void Spool::append(std::span<const int32_t> values) {
  staging_.resize(values.size() * width_);
  for (size_t i = 0; i < values.size(); ++i) {
    const uint32_t value = static_cast<uint32_t>(values[i]);
    std::memcpy(staging_.data() + i * width_, &value, width_);  // little-endian low bytes
  }
  DSTRAIN_USER_CHECK(std::fwrite(staging_.data(), 1, staging_.size(), file_.get()) ==
                     staging_.size())
      << "cannot write the scratch file '" << path_ << "': " << std::strerror(errno) << ".";
  count_ += values.size();
}

void Spool::rewind() {
  DSTRAIN_USER_CHECK(std::fflush(file_.get()) == 0 && std::fseek(file_.get(), 0, SEEK_SET) == 0)
      << "cannot write the scratch file '" << path_ << "': " << std::strerror(errno) << ".";
}

void Spool::read(size_t count, std::vector<int32_t>& out) {
  staging_.resize(count * width_);
  DSTRAIN_USER_CHECK(std::fread(staging_.data(), 1, staging_.size(), file_.get()) ==
                     staging_.size())
      << "cannot read back the scratch file '" << path_ << "'.";
  out.assign(count, 0);
  for (size_t i = 0; i < count; ++i) {
    uint32_t value = 0;
    std::memcpy(&value, staging_.data() + i * width_, width_);
    out[i] = static_cast<int32_t>(value);
  }
}

void remove_stale_shards(const std::string& out_dir, const char* split, size_t first_stale,
                         bool keep_masks) {
  const std::regex pattern(std::string(split) + "_([0-9]{6})\\.(bin|mask)");
  for (const fs::directory_entry& entry : fs::directory_iterator(out_dir)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, pattern)) continue;
    const bool stale = std::stoul(match[1].str()) >= first_stale;
    if (!stale && (keep_masks || match[2].str() == "bin")) continue;
    std::error_code error;
    fs::remove(entry.path(), error);
    DSTRAIN_USER_CHECK(!error) << "could not remove the stale shard '" << entry.path().string()
                               << "' left by an earlier prepare: " << error.message() << ".";
  }
}

std::string move_into_place(const fs::path& staging, const std::string& out_dir,
                            const std::string& name) {
  const fs::path target = fs::path(out_dir) / name;
  std::error_code error;
  fs::rename(staging / name, target, error);
  DSTRAIN_USER_CHECK(!error) << "cannot move the finished shard into place at '" << target.string()
                             << "': " << error.message() << ".";
  return target.string();
}

}  // namespace dstrain
