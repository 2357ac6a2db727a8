// File-system helpers with crash-safe writes. After a crash (process or machine) a reader sees
// either the old file or the new one, never a mix: we write a temp file in the same directory,
// fsync it, rename it over the target and fsync the directory (a rename is atomic within one
// file system, and the directory fsync makes the rename itself durable).
//
// Every failure throws dstrain::UserError with one sentence naming the path and the reason
// (strerror): a missing directory, a full disk or a read-only mount is for the user to fix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

// The whole file. Throws UserError naming the path when it is missing, a directory or
// unreadable.
std::string read_file(const std::filesystem::path& path);

// Replaces (or creates) `path` with `bytes` atomically. On any failure the temp file is
// removed, an existing `path` is left untouched, and UserError names the path and the reason.
// A symbolic link at `path` is replaced by the file, not followed.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// Replaces (or creates) `link` with a symbolic link to `target` atomically (made under a temp
// name, renamed over `link`, the directory fsynced): a reader finds the old link (or file) or
// the new link, never none. UserError naming the path on failure.
void replace_symlink_atomic(const std::filesystem::path& link, const std::filesystem::path& target);

// Makes the creations, renames and removals inside directory `path` durable.
void fsync_directory(const std::filesystem::path& path);

// fsyncs `path` and, when it is a directory, every regular file and directory below it.
// Symbolic links are not followed; other special files are skipped.
void fsync_tree(const std::filesystem::path& path);

// write_file_atomic for contents that are written piece by piece (a multi-GB checkpoint is
// never built in memory). The target appears, whole, only when commit() returns.
//
//   AtomicFileWriter out(path);
//   out.write(header);
//   out.write(data, size);
//   out.commit();            // without it, the destructor removes the temp file
class AtomicFileWriter {
 public:
  // Creates the temp file `<dir>/.<name>.tmp-<pid>-<n>` next to `path`.
  explicit AtomicFileWriter(std::filesystem::path path);
  ~AtomicFileWriter();  // removes the temp file unless commit() succeeded
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // REQUIRES: not committed. A failed write removes the temp file before it throws.
  void write(const void* data, size_t size);
  void write(std::string_view bytes) { write(bytes.data(), bytes.size()); }
  // fsync, close, rename over the target, fsync the directory.
  // REQUIRES: called at most once, after the last write().
  void commit();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  void abandon() noexcept;  // close and remove the temp file

  std::filesystem::path path_;
  std::filesystem::path temp_path_;
  int fd_ = -1;
  uint64_t bytes_written_ = 0;
  bool committed_ = false;
};

// A directory that appears whole or not at all (a checkpoint): it is filled under the name
// `<parent>/.tmp-<name>-<tag>` (tag: the pid by default) and published by commit() with one
// rename. Processes on other machines sharing the storage may write into it too, under the
// same tag (staging_path()), as long as they are done before commit().
//
//   StagingDir staging(run_dir / "step-000100");
//   write_file_atomic(staging.path() / "config.json", config_text);   // any writes
//   staging.commit();        // fsync all, rename to run_dir/step-000100, fsync run_dir
//
// Without commit() the destructor removes the staging directory recursively.
// REQUIRES: at most one StagingDir per final path and tag at a time (a leftover of a crashed
// run with the same tag is removed first).
// The staging directory StagingDir(final_path, tag) fills (tag "": this process's pid).
std::filesystem::path staging_path(const std::filesystem::path& final_path, const std::string& tag);

class StagingDir {
 public:
  // Creates the parent directories when missing, and the (empty) staging directory.
  explicit StagingDir(std::filesystem::path final_path, std::string tag = "");
  ~StagingDir();
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;

  // Where to write the contents. REQUIRES: not committed.
  const std::filesystem::path& path() const { return staging_path_; }
  const std::filesystem::path& final_path() const { return final_path_; }
  bool committed() const { return committed_; }

  // fsyncs every file and directory inside, renames the staging directory to the final path
  // and fsyncs the parent. An existing final directory is swapped out atomically
  // (renameat2 RENAME_EXCHANGE) and then removed, so a reader always sees a whole one.
  // REQUIRES: called at most once.
  void commit();

 private:
  std::filesystem::path final_path_;
  std::filesystem::path staging_path_;
  bool committed_ = false;
};

// A file mapped read-only into memory (mmap), or read into a buffer where mapping fails.
// Move-only. The bytes stay valid while the MappedFile lives; the file must not be truncated
// meanwhile (touching pages past the new end raises SIGBUS).
class MappedFile {
 public:
  // Throws UserError naming the path when it is missing, a directory or unreadable.
  static MappedFile open(const std::filesystem::path& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }  // nullptr for an empty file
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  void release() noexcept;

  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;           // data_ comes from mmap (else from fallback_)
  std::vector<uint8_t> fallback_;  // the contents when mmap was not possible
};

}  // namespace dstrain
