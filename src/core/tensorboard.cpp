#include "core/tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <system_error>

#include "core/check.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

// ---- CRC-32C ----------------------------------------------------------------------------

// table[b]: the CRC register after shifting byte b through eight reflected steps.
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  constexpr uint32_t kReflectedPolynomial = 0x82F63B78u;
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kReflectedPolynomial : 0u);
    table[byte] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

// ---- protobuf wire format -----------------------------------------------------------------

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void put_key(std::string& out, uint32_t field, WireType type) {
  put_varint(out, (field << 3) | type);
}

template <class Word>
void put_little_endian(std::string& out, Word word) {
  for (size_t i = 0; i < sizeof(Word); ++i)
    out.push_back(static_cast<char>((word >> (8 * i)) & 0xFF));
}

void put_double(std::string& out, uint32_t field, double value) {
  put_key(out, field, kFixed64);
  put_little_endian(out, std::bit_cast<uint64_t>(value));
}

void put_float(std::string& out, uint32_t field, float value) {
  put_key(out, field, kFixed32);
  put_little_endian(out, std::bit_cast<uint32_t>(value));
}

// int64 fields are varints of the two's complement: a negative value takes ten bytes.
void put_int64(std::string& out, uint32_t field, int64_t value) {
  put_key(out, field, kVarint);
  put_varint(out, static_cast<uint64_t>(value));
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

// Event fields 1 and 2, left out at their proto3 defaults as protobuf's serializer does.
std::string event_header(double wall_time, int64_t step) {
  std::string event;
  if (std::bit_cast<uint64_t>(wall_time) != 0) put_double(event, 1, wall_time);
  if (step != 0) put_int64(event, 2, step);
  return event;
}

// Summary.Value: tag = 1, simple_value = 2 (in a oneof: written even when 0).
std::string summary_value(const TensorBoardScalar& scalar) {
  DSTRAIN_CHECK(!scalar.tag.empty()) << "a TensorBoard scalar needs a tag";
  std::string value;
  put_bytes(value, 1, scalar.tag);
  put_float(value, 2, static_cast<float>(scalar.value));
  return value;
}

// ---- the event file -----------------------------------------------------------------------

constexpr size_t kFlushBytes = size_t{1} << 20;

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// `dir`, created with its parents when missing.
void make_directory(const fs::path& dir) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (!error && !fs::is_directory(dir, error) && !error) {
    error = std::make_error_code(std::errc::not_a_directory);
  }
  DSTRAIN_USER_CHECK(!error) << "cannot use '" << dir.string()
                             << "' as the TensorBoard directory: " << error.message() << ".";
}

// Creates a new event file in `dir` and returns its descriptor; `path` receives its name.
// O_EXCL: a name that exists (an earlier run's file) is skipped, never opened.
int create_event_file(const fs::path& dir, fs::path& path) {
  static std::atomic<uint64_t> writers{0};
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%010lld", static_cast<long long>(unix_seconds_now()));
  const std::string prefix = std::string("events.out.tfevents.") + seconds + "." + host_name() +
                             "." + std::to_string(::getpid()) + ".";
  while (true) {
    path = dir / (prefix + std::to_string(writers.fetch_add(1)));
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) return fd;
    const int error = errno;
    DSTRAIN_USER_CHECK(error == EEXIST) << "cannot create the TensorBoard event file '"
                                        << path.string() << "': " << std::strerror(error) << ".";
  }
}

// ---- JSONL records ------------------------------------------------------------------------

// An array element that names itself: an object with an integer "layer" or "stage" field.
struct ElementName {
  std::string field;  // "layer"
  std::string name;   // "layer_3", used instead of the element's index
};

std::optional<ElementName> element_name(const nlohmann::json& element) {
  if (!element.is_object()) return std::nullopt;
  for (const char* field : {"layer", "stage"}) {
    const auto found = element.find(field);
    if (found != element.end() && found->is_number_integer()) {
      return ElementName{field, std::string(field) + "_" + std::to_string(found->get<int64_t>())};
    }
  }
  return std::nullopt;
}

void collect_scalars(const nlohmann::json& value, const std::string& tag,
                     std::vector<TensorBoardScalar>& out);

// Every member of `object` but `skipped`, its key joined to `prefix` ("" at the top).
void collect_members(const nlohmann::json& object, const std::string& prefix,
                     std::string_view skipped, std::vector<TensorBoardScalar>& out) {
  for (const auto& [key, member] : object.items()) {
    if (key == skipped) continue;
    collect_scalars(member, prefix.empty() ? key : prefix + "/" + key, out);
  }
}

void collect_array(const nlohmann::json& array, const std::string& tag,
                   std::vector<TensorBoardScalar>& out) {
  for (size_t i = 0; i < array.size(); ++i) {
    const nlohmann::json& element = array[i];
    if (const std::optional<ElementName> named = element_name(element)) {
      collect_members(element, tag + "/" + named->name, named->field, out);
    } else {
      collect_scalars(element, tag + "/" + std::to_string(i), out);
    }
  }
}

void collect_scalars(const nlohmann::json& value, const std::string& tag,
                     std::vector<TensorBoardScalar>& out) {
  if (value.is_object()) {
    collect_members(value, tag, "", out);
  } else if (value.is_array()) {
    collect_array(value, tag, out);
  } else if (value.is_boolean()) {
    out.push_back({tag, value.get<bool>() ? 1.0 : 0.0});
  } else if (value.is_number()) {
    out.push_back({tag, value.get<double>()});
  }  // strings and nulls: nothing to draw
}

}  // namespace

uint32_t crc32c(std::string_view bytes, uint32_t crc) {
  crc = ~crc;
  for (const char c : bytes)
    crc = kCrc32cTable[(crc ^ static_cast<uint8_t>(c)) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(std::string_view data) {
  std::string length;
  put_little_endian(length, static_cast<uint64_t>(data.size()));
  std::string record = length;
  put_little_endian(record, masked_crc32c(length));
  record.append(data);
  put_little_endian(record, masked_crc32c(data));
  return record;
}

std::string file_version_event(double wall_time) {
  std::string event = event_header(wall_time, 0);
  put_bytes(event, 3, "brain.Event:2");
  return event;
}

std::string scalars_event(double wall_time, int64_t step,
                          std::span<const TensorBoardScalar> scalars) {
  std::string summary;
  for (const TensorBoardScalar& scalar : scalars) put_bytes(summary, 1, summary_value(scalar));
  std::string event = event_header(wall_time, step);
  put_bytes(event, 5, summary);
  return event;
}

std::string session_start_event(double wall_time, int64_t step) {
  constexpr int64_t kStart = 1;  // SessionLog.SessionStatus.START
  std::string session_log;
  put_int64(session_log, 1, kStart);
  std::string event = event_header(wall_time, step);
  put_bytes(event, 7, session_log);
  return event;
}

double unix_seconds_now() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  return std::chrono::duration<double>(since_epoch).count();
}

TensorBoardWriter::TensorBoardWriter(const fs::path& dir, std::optional<int64_t> start_step) {
  make_directory(dir);
  fd_ = create_event_file(dir, path_);
  const double now = unix_seconds_now();
  queue_event(file_version_event(now));
  if (start_step) queue_event(session_start_event(now, *start_step));
  try {
    flush();
  } catch (...) {
    ::close(fd_);  // the destructor of a half-made object does not run
    throw;
  }
}

TensorBoardWriter::~TensorBoardWriter() {
  try {
    flush();
  } catch (const std::exception&) {
    // A destructor cannot report it; callers that care call flush() first.
  }
  ::close(fd_);
}

void TensorBoardWriter::add_scalar(std::string_view tag, int64_t step, double value,
                                   double wall_time) {
  const TensorBoardScalar scalar{std::string(tag), value};
  add_scalars(step, std::span<const TensorBoardScalar>(&scalar, 1), wall_time);
}

void TensorBoardWriter::add_scalars(int64_t step, std::span<const TensorBoardScalar> scalars,
                                    double wall_time) {
  if (scalars.empty()) return;
  queue_event(scalars_event(wall_time, step, scalars));
}

void TensorBoardWriter::queue_event(const std::string& event) {
  queued_ += tfrecord(event);
  if (queued_.size() >= kFlushBytes) flush();
}

void TensorBoardWriter::flush() {
  size_t done = 0;
  while (done < queued_.size()) {
    const ssize_t written = ::write(fd_, queued_.data() + done, queued_.size() - done);
    if (written < 0 && errno == EINTR) continue;
    if (written <= 0) {
      const int error = written < 0 ? errno : EIO;
      queued_.erase(0, done);  // what reached the file is not written twice
      DSTRAIN_USER_ERROR() << "writing the TensorBoard event file '" << path_.string()
                           << "' failed: " << std::strerror(error) << ".";
    }
    done += static_cast<size_t>(written);
  }
  queued_.clear();
}

LogScalars scalars_of_log_record(const nlohmann::json& record, int64_t start_step) {
  LogScalars result;
  if (!record.is_object()) return result;
  const auto step = record.find("step");
  if (step != record.end() && step->is_number_integer()) {
    result.step = step->get<int64_t>();
    collect_members(record, "", "step", result.scalars);
    return result;
  }
  const auto type = record.find("type");
  if (type == record.end() || !type->is_string() || *type == "config") return result;
  const std::string prefix = type->get<std::string>();
  const auto steps = record.find("steps");
  const bool summary = prefix == "summary" && steps != record.end() && steps->is_number_integer();
  result.step = summary ? steps->get<int64_t>() : start_step;
  collect_members(record, prefix, "", result.scalars);
  return result;
}

}  // namespace dstrain
