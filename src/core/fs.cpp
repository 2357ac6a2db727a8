#include "core/fs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "core/check.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

std::string errno_text(int error) { return std::strerror(error); }

// The directory that holds `path` ("." for a bare file name).
fs::path parent_of(const fs::path& path) {
  fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// A name that no other writer in this process uses (threads may write side by side).
std::string unique_suffix() {
  static std::atomic<uint64_t> counter{0};
  return std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1));
}

void close_quietly(int fd) noexcept {
  if (fd >= 0) ::close(fd);
}

// fsync one file or directory by path.
void fsync_path(const fs::path& path, bool directory) {
  const int flags = O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0);
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    const int error = errno;
    DSTRAIN_USER_ERROR() << "cannot open '" << path.string() << "' to sync it: "
                         << errno_text(error) << ".";
  }
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    DSTRAIN_USER_ERROR() << "cannot sync '" << path.string() << "' to disk: "
                         << errno_text(error) << ".";
  }
  ::close(fd);
}

// Opens `path` for reading; throws a clear sentence when it is missing or a directory.
int open_for_reading(const fs::path& path, struct stat* info) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    DSTRAIN_USER_ERROR() << "cannot read '" << path.string() << "': " << errno_text(error) << ".";
  }
  if (::fstat(fd, info) != 0) {
    const int error = errno;
    ::close(fd);
    DSTRAIN_USER_ERROR() << "cannot read '" << path.string() << "': " << errno_text(error) << ".";
  }
  if (S_ISDIR(info->st_mode)) {
    ::close(fd);
    DSTRAIN_USER_ERROR() << "cannot read '" << path.string() << "': it is a directory, not a file.";
  }
  return fd;
}

// Reads exactly `size` bytes (fewer only at end of file); returns how many were read.
size_t read_fully(int fd, const fs::path& path, uint8_t* out, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t got = ::read(fd, out + done, size - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      const int error = errno;
      ::close(fd);
      DSTRAIN_USER_ERROR() << "cannot read '" << path.string() << "': " << errno_text(error)
                           << ".";
    }
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

}  // namespace

std::string read_file(const fs::path& path) {
  struct stat info {};
  const int fd = open_for_reading(path, &info);
  std::string contents(static_cast<size_t>(info.st_size), '\0');
  size_t done = read_fully(fd, path, reinterpret_cast<uint8_t*>(contents.data()), contents.size());
  // Files whose size stat does not know (pipes, /proc) are read to their end.
  if (done == contents.size()) {
    uint8_t chunk[65536];
    while (size_t got = read_fully(fd, path, chunk, sizeof(chunk))) {
      contents.append(reinterpret_cast<const char*>(chunk), got);
      done += got;
    }
  }
  contents.resize(done);
  ::close(fd);
  return contents;
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  AtomicFileWriter out(path);
  out.write(bytes);
  out.commit();
}

void replace_symlink_atomic(const fs::path& link, const fs::path& target) {
  const fs::path temp = parent_of(link) / ("." + link.filename().string() + ".tmp-" + unique_suffix());
  if (::symlink(target.c_str(), temp.c_str()) != 0) {
    DSTRAIN_USER_ERROR() << "cannot create the link '" << link.string() << "': "
                         << errno_text(errno) << ".";
  }
  if (::rename(temp.c_str(), link.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    DSTRAIN_USER_ERROR() << "cannot replace '" << link.string() << "' with a link: "
                         << errno_text(error) << ".";
  }
  fsync_directory(parent_of(link));
}

void fsync_directory(const fs::path& path) { fsync_path(path, /*directory=*/true); }

void fsync_tree(const fs::path& path) {
  std::error_code error;
  const fs::file_status status = fs::symlink_status(path, error);
  DSTRAIN_USER_CHECK(!error) << "cannot sync '" << path.string() << "': " << error.message()
                             << ".";
  if (fs::is_regular_file(status)) {
    fsync_path(path, /*directory=*/false);
    return;
  }
  if (!fs::is_directory(status)) return;  // links are not followed; fifos would block
  // Children first, the directory last: its entries then name durable files.
  fs::directory_iterator entries(path, error);
  DSTRAIN_USER_CHECK(!error) << "cannot list '" << path.string() << "': " << error.message()
                             << ".";
  for (; entries != fs::directory_iterator(); entries.increment(error)) {
    fsync_tree(entries->path());
  }
  DSTRAIN_USER_CHECK(!error) << "cannot list '" << path.string() << "': " << error.message()
                             << ".";
  fsync_path(path, /*directory=*/true);
}

// ---------------------------------------------------------------------------------------------
// AtomicFileWriter

AtomicFileWriter::AtomicFileWriter(fs::path path) : path_(std::move(path)) {
  DSTRAIN_USER_CHECK(!path_.filename().empty())
      << "cannot write '" << path_.string() << "': the path names a directory, not a file.";
  const fs::path directory = parent_of(path_);
  while (true) {
    temp_path_ = directory / ("." + path_.filename().string() + ".tmp-" + unique_suffix());
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ >= 0) break;
    const int error = errno;
    if (error == EEXIST) continue;  // a leftover of a crashed run with our pid: next number
    DSTRAIN_USER_ERROR() << "cannot write '" << path_.string() << "': cannot create a file in '"
                         << directory.string() << "': " << errno_text(error) << ".";
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) abandon();
}

void AtomicFileWriter::abandon() noexcept {
  close_quietly(fd_);
  fd_ = -1;
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  temp_path_.clear();
}

void AtomicFileWriter::write(const void* data, size_t size) {
  DSTRAIN_CHECK(fd_ >= 0 && !committed_) << "write to '" << path_.string()
                                         << "' after commit or failure";
  const char* bytes = static_cast<const char*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t wrote = ::write(fd_, bytes + done, size - done);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote < 0) {
      const int error = errno;
      abandon();
      DSTRAIN_USER_ERROR() << "cannot write '" << path_.string() << "': " << errno_text(error)
                           << ".";
    }
    done += static_cast<size_t>(wrote);
  }
  bytes_written_ += size;
}

void AtomicFileWriter::commit() {
  DSTRAIN_CHECK(fd_ >= 0 && !committed_) << "commit of '" << path_.string()
                                         << "' twice or after a failure";
  if (::fsync(fd_) != 0) {
    const int error = errno;
    abandon();
    DSTRAIN_USER_ERROR() << "cannot write '" << path_.string() << "': sync to disk failed: "
                         << errno_text(error) << ".";
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {  // some file systems (NFS) report write errors only here
    const int error = errno;
    abandon();
    DSTRAIN_USER_ERROR() << "cannot write '" << path_.string() << "': " << errno_text(error)
                         << ".";
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    abandon();
    DSTRAIN_USER_ERROR() << "cannot write '" << path_.string() << "': renaming the finished "
                         << "temp file over it failed: " << errno_text(error) << ".";
  }
  committed_ = true;
  temp_path_.clear();
  fsync_directory(parent_of(path_));
}

// ---------------------------------------------------------------------------------------------
// StagingDir

static fs::path without_trailing_separator(fs::path path) {
  // "run/step-000100/" has an empty filename.
  return path.filename().empty() ? path.parent_path() : path;
}

fs::path staging_path(const fs::path& final_path, const std::string& tag) {
  const fs::path path = without_trailing_separator(final_path);
  return parent_of(path) / (".tmp-" + path.filename().string() + "-" +
                            (tag.empty() ? std::to_string(::getpid()) : tag));
}

StagingDir::StagingDir(fs::path final_path, std::string tag)
    : final_path_(without_trailing_separator(std::move(final_path))) {
  DSTRAIN_USER_CHECK(!final_path_.filename().empty())
      << "cannot create directory '" << final_path_.string() << "': no directory name.";
  const fs::path parent = parent_of(final_path_);
  std::error_code error;
  fs::create_directories(parent, error);
  DSTRAIN_USER_CHECK(!error) << "cannot create directory '" << parent.string()
                             << "': " << error.message() << ".";
  staging_path_ = staging_path(final_path_, tag);
  fs::remove_all(staging_path_, error);  // a leftover of a crashed run that had our tag
  DSTRAIN_USER_CHECK(!error) << "cannot remove the stale directory '" << staging_path_.string()
                             << "': " << error.message() << ".";
  if (::mkdir(staging_path_.c_str(), 0777) != 0) {
    const int mkdir_error = errno;
    DSTRAIN_USER_ERROR() << "cannot create directory '" << staging_path_.string()
                         << "': " << errno_text(mkdir_error) << ".";
  }
}

StagingDir::~StagingDir() {
  if (committed_) return;
  std::error_code ignored;
  fs::remove_all(staging_path_, ignored);
}

void StagingDir::commit() {
  DSTRAIN_CHECK(!committed_) << "commit of '" << final_path_.string() << "' twice";
  fsync_tree(staging_path_);
  const fs::path parent = parent_of(final_path_);
  std::error_code error;
  const bool replacing = fs::exists(fs::symlink_status(final_path_, error));
  if (!replacing) {
    if (::rename(staging_path_.c_str(), final_path_.c_str()) != 0) {
      const int rename_error = errno;
      DSTRAIN_USER_ERROR() << "cannot create '" << final_path_.string() << "': renaming '"
                           << staging_path_.string()
                           << "' to it failed: " << errno_text(rename_error) << ".";
    }
    committed_ = true;
    fsync_directory(parent);
    return;
  }
  // Swap new and old in one step, then delete the old one (now under the staging name).
  if (::renameat2(AT_FDCWD, staging_path_.c_str(), AT_FDCWD, final_path_.c_str(),
                  RENAME_EXCHANGE) != 0) {
    const int exchange_error = errno;
    DSTRAIN_USER_ERROR() << "cannot replace '" << final_path_.string() << "': "
                         << errno_text(exchange_error) << "; remove it and try again.";
  }
  committed_ = true;
  fsync_directory(parent);
  fs::remove_all(staging_path_, error);
  DSTRAIN_USER_CHECK(!error) << "cannot remove the replaced directory (now '"
                             << staging_path_.string() << "'): " << error.message() << ".";
  fsync_directory(parent);
}

// ---------------------------------------------------------------------------------------------
// MappedFile

MappedFile MappedFile::open(const fs::path& path) {
  MappedFile file;
  file.path_ = path;
  struct stat info {};
  const int fd = open_for_reading(path, &info);
  file.size_ = static_cast<size_t>(info.st_size);
  if (file.size_ == 0) {
    ::close(fd);
    return file;
  }
  void* mapping = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
  if (mapping != MAP_FAILED) {
    file.data_ = static_cast<const uint8_t*>(mapping);
    file.mapped_ = true;
    ::close(fd);  // the mapping keeps the file open
    return file;
  }
  // Not mappable (some special files and file systems): read it instead.
  file.fallback_.resize(file.size_);
  file.size_ = read_fully(fd, path, file.fallback_.data(), file.size_);
  ::close(fd);
  file.fallback_.resize(file.size_);
  file.data_ = file.fallback_.data();
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept { *this = std::move(other); }

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this == &other) return *this;
  release();
  path_ = std::move(other.path_);
  size_ = other.size_;
  mapped_ = other.mapped_;
  fallback_ = std::move(other.fallback_);  // moving a vector keeps its buffer address
  data_ = other.data_;
  other.data_ = nullptr;
  other.size_ = 0;
  other.mapped_ = false;
  return *this;
}

MappedFile::~MappedFile() { release(); }

void MappedFile::release() noexcept {
  if (mapped_ && data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
  mapped_ = false;
  fallback_.clear();
}

}  // namespace dstrain
