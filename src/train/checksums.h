// A checkpoint's checksums: checksums.json holds the size and CRC-32 of every file it wrote,
// computed from the bytes as they were written (no second read). Several ranks, threads or
// nodes write parts of the same file: each records the CRC-32 of the ranges it wrote in the
// staging directory, and the writer that commits combines them (zlib's crc32_combine) into
// each file's CRC-32, after checking that the ranges cover every byte of the file once.
// Verifying reads every file back.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

// CRC-32 (zlib's, the polynomial of gzip and PNG) of `bytes`, continuing from `crc`.
uint32_t crc32_of(std::string_view bytes, uint32_t crc = 0);

// Bytes [offset, offset + bytes) of a file, written with CRC-32 `crc`.
struct WrittenRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

// The ranges one writer wrote, by file name (relative to the staging directory). Ranges that
// follow each other are merged as they come.
class WrittenRanges {
 public:
  void add(const std::string& file, uint64_t offset, std::string_view bytes);
  void add_whole(const std::string& file, std::string_view bytes) { add(file, 0, bytes); }
  bool empty() const { return ranges_.empty(); }
  // Into a record file of its own in `staging` (a unique name: several threads, processes and
  // nodes record at once), then cleared.
  void record(const std::filesystem::path& staging);

 private:
  std::map<std::string, std::vector<WrittenRange>> ranges_;
};

// The committing writer, after every writer has recorded: combines the records into
// checksums.json (each recorded file's size and CRC-32) and removes them. Every recorded file
// must be covered exactly by its ranges (an internal error otherwise).
void write_checksums(const std::filesystem::path& staging);

// What verify_checkpoint found in a checkpoint directory.
struct Verification {
  bool has_checksums = false;  // false: written before dstrain recorded checksums
  std::string damage;          // "" when whole; else one clause: "model.safetensors: ..."
  size_t files = 0;            // files checked
  uint64_t bytes = 0;          // and their bytes
};
// Reads every file checksums.json names, as the storage holds it (cached pages dropped first),
// and compares its size and CRC-32.
Verification verify_checkpoint(const std::filesystem::path& dir);

// verify_checkpoint(dir), writing each file as it is read into directory `into` (which must
// exist), and then the files checksums.json does not name (itself). Each file appears there
// whole or not at all; the copy is complete only when the result has checksums and no damage.
// A file that cannot be written there is a UserError naming it.
Verification copy_checkpoint(const std::filesystem::path& dir, const std::filesystem::path& into);

}  // namespace dstrain
