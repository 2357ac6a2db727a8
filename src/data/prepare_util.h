// What `dstrain prepare` (text, data/prepare.h) and `dstrain prepare --chat`
// (data/prepare_chat.h) share: shard names, the staging directory, a scratch spool of values,
// and the removal of stale shards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace dstrain {

// "train_000003.bin" (split "train", index 3), or with `extension` ".mask" its mask's name.
std::string shard_name(const char* split, size_t index, const char* extension = ".bin");

struct FileCloser {
  void operator()(std::FILE* file) const { std::fclose(file); }
};

// Removes a directory tree on scope exit.
struct TreeRemover {
  std::filesystem::path path;
  ~TreeRemover();
};

// The hidden staging directory out_dir/.prepare-tmp-<pid> (out_dir created when missing, an
// older staging directory of this pid removed). Throws UserError naming what cannot be created.
std::filesystem::path make_staging_directory(const std::string& out_dir);

// A scratch file of values, `width` (1, 2 or 4) bytes each: written once, then read once from
// the start. Lets prepare learn the counts (for the split and the shard headers) without
// holding the data in memory.
class Spool {
 public:
  Spool(const std::filesystem::path& path, size_t width);

  // REQUIRES: every value in [0, 2^(8 * width)); not rewound yet.
  void append(std::span<const int32_t> values);
  size_t size() const { return count_; }
  void rewind();
  // The next `count` values. REQUIRES: rewound; no more than were appended.
  void read(size_t count, std::vector<int32_t>& out);

 private:
  std::string path_;
  size_t width_;
  std::unique_ptr<std::FILE, FileCloser> file_;
  std::vector<unsigned char> staging_;
  size_t count_ = 0;
};

// Removes split_NNNNNN.bin and split_NNNNNN.mask files in out_dir numbered `first_stale` and
// above, and split_NNNNNN.mask files below it when `keep_masks` is false (text shards that
// replaced chat shards). Throws UserError when a file cannot be removed.
void remove_stale_shards(const std::string& out_dir, const char* split, size_t first_stale,
                         bool keep_masks);

// Moves staging/name to out_dir/name. Throws UserError when it cannot.
std::string move_into_place(const std::filesystem::path& staging, const std::string& out_dir,
                            const std::string& name);

}  // namespace dstrain
