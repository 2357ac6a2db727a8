#include "data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <regex>
#include <utility>

#include "core/check.h"
#include "core/fs.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

namespace dstrain {

namespace {

namespace fs = std::filesystem;

constexpr size_t kMinInputBytes = 1024;
constexpr size_t kReadChunkBytes = size_t{1} << 22;

std::string shard_name(const char* split, size_t index) {
  char name[64];
  std::snprintf(name, sizeof(name), "%s_%06zu.bin", split, index);
  return name;
}

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

// Removes a directory tree on scope exit.
struct TreeRemover {
  fs::path path;
  ~TreeRemover() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

// Streams the next `bytes` bytes of `input` into shards staging/split_NNNNNN.bin of at most
// max_shard_tokens tokens; returns the shard names.
std::vector<std::string> write_split(std::FILE* input, const std::string& input_path,
                                     size_t bytes, const fs::path& staging, const char* split,
                                     size_t max_shard_tokens) {
  const ByteTokenizer tokenizer;
  std::vector<std::string> names;
  std::string chunk;
  size_t remaining = bytes;
  while (remaining > 0) {
    names.push_back(shard_name(split, names.size()));
    const size_t shard_tokens = std::min(remaining, max_shard_tokens);
    TokenFileWriter writer((staging / names.back()).string(), TokenFormat::kLlmcU16,
                           shard_tokens);
    for (size_t left = shard_tokens; left > 0;) {
      chunk.resize(std::min(left, kReadChunkBytes));
      const size_t got = std::fread(chunk.data(), 1, chunk.size(), input);
      DSTRAIN_USER_CHECK(got == chunk.size())
          << "could not read input text file '" << input_path << "' to its end ("
          << (std::ferror(input) ? std::strerror(errno) : "it became shorter while being read")
          << ").";
      writer.append(tokenizer.encode(chunk));
      left -= got;
    }
    writer.commit();
    remaining -= shard_tokens;
  }
  return names;
}

// Removes split_NNNNNN.bin files in out_dir numbered `first_stale` and above.
void remove_stale_shards(const std::string& out_dir, const char* split, size_t first_stale) {
  const std::regex pattern(std::string(split) + "_([0-9]{6})\\.bin");
  for (const fs::directory_entry& entry : fs::directory_iterator(out_dir)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, pattern)) continue;
    if (std::stoul(match[1].str()) < first_stale) continue;
    std::error_code error;
    fs::remove(entry.path(), error);
    DSTRAIN_USER_CHECK(!error) << "could not remove the stale shard '" << entry.path().string()
                               << "' left by an earlier prepare: " << error.message() << ".";
  }
}

}  // namespace

PrepareResult prepare(const std::string& input_txt_path, const std::string& out_dir,
                      double val_fraction, size_t max_shard_tokens) {
  DSTRAIN_CHECK(max_shard_tokens >= 1 &&
                max_shard_tokens <= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      << "max_shard_tokens " << max_shard_tokens;
  DSTRAIN_USER_CHECK(val_fraction > 0.0 && val_fraction < 1.0)
      << "the validation fraction must be between 0 and 1 (exclusive), not " << val_fraction
      << ".";
  std::error_code error;
  const fs::file_status status = fs::status(input_txt_path, error);
  DSTRAIN_USER_CHECK(fs::exists(status))
      << "input text file '" << input_txt_path << "' does not exist.";
  DSTRAIN_USER_CHECK(!fs::is_directory(status))
      << "input text path '" << input_txt_path << "' is a directory; give a text file.";
  const size_t size = static_cast<size_t>(fs::file_size(input_txt_path, error));
  DSTRAIN_USER_CHECK(!error) << "cannot read the size of input text file '" << input_txt_path
                             << "': " << error.message() << ".";
  DSTRAIN_USER_CHECK(size >= kMinInputBytes)
      << "input text file '" << input_txt_path << "' has only " << size
      << " bytes; prepare needs at least " << kMinInputBytes
      << " bytes so that both the training and the validation split are useful.";
  const size_t val_bytes = std::max<size_t>(
      1, static_cast<size_t>(std::llround(val_fraction * static_cast<double>(size))));
  DSTRAIN_USER_CHECK(val_bytes < size)
      << "a validation fraction of " << val_fraction << " leaves no training text in '"
      << input_txt_path << "'; use a smaller fraction.";
  const size_t train_bytes = size - val_bytes;

  fs::create_directories(out_dir, error);
  DSTRAIN_USER_CHECK(!error) << "cannot create the output directory '" << out_dir
                             << "': " << error.message() << ".";
  std::unique_ptr<std::FILE, FileCloser> input(std::fopen(input_txt_path.c_str(), "rb"));
  DSTRAIN_USER_CHECK(input != nullptr) << "cannot open input text file '" << input_txt_path
                                       << "': " << std::strerror(errno) << ".";

  // The shards are written into a hidden staging directory inside out_dir (same file system)
  // and moved out only when all are complete, so a failure leaves out_dir as it was.
  const fs::path staging = fs::path(out_dir) / (".prepare-tmp-" + std::to_string(::getpid()));
  fs::remove_all(staging, error);  // a leftover of a crashed run with our pid
  fs::create_directory(staging, error);
  DSTRAIN_USER_CHECK(!error) << "cannot create the directory '" << staging.string()
                             << "': " << error.message() << ".";
  const TreeRemover remove_staging{staging};
  const std::vector<std::string> train_names = write_split(
      input.get(), input_txt_path, train_bytes, staging, "train", max_shard_tokens);
  const std::vector<std::string> val_names =
      write_split(input.get(), input_txt_path, val_bytes, staging, "val", max_shard_tokens);

  PrepareResult result;
  result.train_tokens = train_bytes;
  result.val_tokens = val_bytes;
  for (const auto& [names, files] : {std::pair{&train_names, &result.train_files},
                                     std::pair{&val_names, &result.val_files}}) {
    for (const std::string& name : *names) {
      const fs::path target = fs::path(out_dir) / name;
      fs::rename(staging / name, target, error);
      DSTRAIN_USER_CHECK(!error) << "cannot move the finished shard into place at '"
                                 << target.string() << "': " << error.message() << ".";
      files->push_back(target.string());
    }
  }
  fsync_directory(out_dir);
  remove_stale_shards(out_dir, "train", result.train_files.size());
  remove_stale_shards(out_dir, "val", result.val_files.size());
  return result;
}

}  // namespace dstrain
