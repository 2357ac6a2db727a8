#include "train/checksums.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/fs.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRecordPrefix = ".checksum-ranges-";
constexpr const char* kChecksumsFile = "checksums.json";

std::string hex(uint32_t crc) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

// A name no other writer of the same staging directory uses: this host, process and call.
std::string record_name() {
  static std::atomic<uint64_t> calls{0};
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return std::string(kRecordPrefix) + host + "-" + std::to_string(::getpid()) + "-" +
         std::to_string(calls.fetch_add(1)) + ".json";
}

// The CRC-32 of file `path` as the storage holds it (its cached pages dropped first where the
// system allows: clean after the writer's fsync), read in pieces, each also given to `copy`
// when set; its size into `bytes`. A file that cannot be read is a UserError naming it.
uint32_t crc32_of_file(const fs::path& path, uint64_t& bytes,
                       const std::function<void(std::string_view)>& copy = {}) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DSTRAIN_USER_CHECK(fd >= 0) << "cannot read " << path.string() << ": " << std::strerror(errno);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  std::vector<char> piece(8 << 20);
  uint32_t crc = 0;
  bytes = 0;
  for (;;) {
    const ssize_t got = ::read(fd, piece.data(), piece.size());
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int read_error = got < 0 ? errno : 0;
      ::close(fd);
      DSTRAIN_USER_CHECK(read_error == 0)
          << "cannot read " << path.string() << ": " << std::strerror(read_error);
      return crc;
    }
    const std::string_view bytes_read(piece.data(), static_cast<size_t>(got));
    crc = crc32_of(bytes_read, crc);
    bytes += bytes_read.size();
    if (copy) copy(bytes_read);
  }
}

// Whether `name` is a plain file name (no directory part): what checksums.json may name.
bool plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

}  // namespace

uint32_t crc32_of(std::string_view bytes, uint32_t crc) {
  uLong value = crc;
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {
    const auto piece = static_cast<uInt>(std::min<size_t>(left, size_t{1} << 30));
    value = ::crc32(value, data, piece);
    data += piece;
    left -= piece;
  }
  return static_cast<uint32_t>(value);
}

void WrittenRanges::add(const std::string& file, uint64_t offset, std::string_view bytes) {
  if (bytes.empty()) return;
  const uint32_t crc = crc32_of(bytes);
  std::vector<WrittenRange>& ranges = ranges_[file];
  if (!ranges.empty() && ranges.back().offset + ranges.back().bytes == offset) {
    WrittenRange& last = ranges.back();
    last.crc =
        static_cast<uint32_t>(::crc32_combine(last.crc, crc, static_cast<z_off_t>(bytes.size())));
    last.bytes += bytes.size();
    return;
  }
  ranges.push_back({offset, bytes.size(), crc});
}

void WrittenRanges::record(const fs::path& staging) {
  if (ranges_.empty()) return;
  nlohmann::json files = nlohmann::json::object();
  for (const auto& [name, ranges] : ranges_) {
    nlohmann::json list = nlohmann::json::array();
    for (const WrittenRange& r : ranges) list.push_back({r.offset, r.bytes, r.crc});
    files[name] = std::move(list);
  }
  write_file_atomic(staging / record_name(), nlohmann::json{{"files", files}}.dump());
  ranges_.clear();
}

void write_checksums(const fs::path& staging) {
  std::map<std::string, std::vector<WrittenRange>> ranges;
  std::vector<fs::path> records;
  for (const fs::directory_entry& entry : fs::directory_iterator(staging)) {
    if (!entry.path().filename().string().starts_with(kRecordPrefix)) continue;
    records.push_back(entry.path());
    const nlohmann::json record = nlohmann::json::parse(read_file(entry.path()));
    for (const auto& [name, list] : record.at("files").items()) {
      for (const nlohmann::json& r : list) {
        ranges[name].push_back(
            {r.at(0).get<uint64_t>(), r.at(1).get<uint64_t>(), r.at(2).get<uint32_t>()});
      }
    }
  }
  nlohmann::json files = nlohmann::json::object();
  for (auto& [name, list] : ranges) {
    std::sort(list.begin(), list.end(),
              [](const WrittenRange& a, const WrittenRange& b) { return a.offset < b.offset; });
    uint64_t covered = 0;
    uint32_t crc = 0;
    for (const WrittenRange& r : list) {
      DSTRAIN_CHECK(r.offset == covered)
          << name << ": the writers' ranges " << (r.offset < covered ? "overlap" : "leave a gap")
          << " at byte " << std::min(r.offset, covered);
      crc = static_cast<uint32_t>(::crc32_combine(crc, r.crc, static_cast<z_off_t>(r.bytes)));
      covered += r.bytes;
    }
    const uint64_t size = fs::file_size(staging / name);
    DSTRAIN_CHECK(covered == size)
        << name << ": the writers wrote " << covered << " of its " << size << " bytes";
    files[name] = {{"bytes", size}, {"crc32", hex(crc)}};
  }
  write_file_atomic(staging / kChecksumsFile,
                    nlohmann::json{{"algorithm", "crc32"}, {"files", files}}.dump(2) + "\n");
  for (const fs::path& record : records) fs::remove(record);
}

namespace {

// checksums.json's list of files in `dir`, or null with v.damage saying what is wrong with it
// (v.has_checksums false when there is none).
std::optional<nlohmann::json> checksum_list(const fs::path& dir, Verification& v) {
  const fs::path list = dir / kChecksumsFile;
  std::error_code error;
  if (!fs::exists(list, error)) return std::nullopt;
  v.has_checksums = true;
  nlohmann::json checksums;
  try {
    checksums = nlohmann::json::parse(read_file(list));
  } catch (const std::exception&) {
    v.damage = std::string(kChecksumsFile) + " is not valid JSON";
    return std::nullopt;
  }
  if (!checksums.is_object() || checksums.value("algorithm", "") != "crc32" ||
      !checksums.contains("files") || !checksums["files"].is_object()) {
    v.damage = std::string(kChecksumsFile) + " is not a dstrain checksum list";
    return std::nullopt;
  }
  for (const auto& [name, entry] : checksums["files"].items()) {
    if (!plain_name(name) || !entry.is_object() || !entry.contains("bytes") ||
        !entry["bytes"].is_number_unsigned() || !entry.contains("crc32") ||
        !entry["crc32"].is_string()) {
      v.damage = std::string(kChecksumsFile) + "'s entry \"" + name + "\" is malformed";
      return std::nullopt;
    }
  }
  return std::move(checksums["files"]);
}

// Reads file `name` of `dir` (also into `copy_into` / name, when that is not empty: whole there
// or absent) and compares its size and CRC-32 with `entry`; false with v.damage set if they
// differ.
bool check_file(const fs::path& dir, const std::string& name, const nlohmann::json& entry,
                const fs::path& copy_into, Verification& v) {
  const fs::path path = dir / name;
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    v.damage = name + " is missing";
    return false;
  }
  const uint64_t expected_bytes = entry["bytes"].get<uint64_t>();
  if (fs::file_size(path, error) != expected_bytes) {
    v.damage = name + " is " + std::to_string(fs::file_size(path, error)) +
               " bytes where the checkpoint wrote " + std::to_string(expected_bytes);
    return false;
  }
  std::optional<AtomicFileWriter> copy;
  if (!copy_into.empty()) copy.emplace(copy_into / name);
  uint64_t bytes = 0;
  const std::string crc = hex(crc32_of_file(path, bytes, [&](std::string_view piece) {
    if (copy) copy->write(piece);
  }));
  if (bytes != expected_bytes || crc != entry["crc32"].get<std::string>()) {
    v.damage = name + " has CRC-32 " + crc + " where the checkpoint wrote " +
               entry["crc32"].get<std::string>();
    return false;
  }
  if (copy) copy->commit();
  ++v.files;
  v.bytes += bytes;
  return true;
}

Verification check_files(const fs::path& dir, const fs::path& copy_into) {
  Verification v;
  const std::optional<nlohmann::json> files = checksum_list(dir, v);
  if (!files) return v;
  for (const auto& [name, entry] : files->items()) {
    if (!check_file(dir, name, entry, copy_into, v)) return v;
  }
  return v;
}

}  // namespace

Verification verify_checkpoint(const fs::path& dir) { return check_files(dir, {}); }

Verification copy_checkpoint(const fs::path& dir, const fs::path& into) {
  Verification v = check_files(dir, into);
  if (!v.has_checksums || !v.damage.empty()) return v;
  // What checksums.json does not name (itself): copied as read.
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const fs::path target = into / entry.path().filename();
    if (!entry.is_regular_file(error) || fs::exists(target, error)) continue;
    AtomicFileWriter copy(target);
    uint64_t bytes = 0;
    crc32_of_file(entry.path(), bytes, [&](std::string_view piece) { copy.write(piece); });
    copy.commit();
  }
  return v;
}

}  // namespace dstrain
