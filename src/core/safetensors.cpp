#include "core/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/fs.h"

// The format is little-endian; so are the machines dstrain runs on (x86-64, aarch64).
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes little-endian");

namespace dstrain {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

// Every reader error starts the same way; the caller finishes the sentence.
#define DSTRAIN_INVALID_SAFETENSORS(path) \
  DSTRAIN_USER_ERROR() << "'" << (path).string() << "' is not a valid safetensors file: "

namespace {

// numel of a shape, or -1 when it overflows int64.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(count, dim, &count)) return -1;
  }
  return count;
}

// numel * element size in bytes, or -1 on overflow.
int64_t checked_nbytes(int64_t numel, DType dtype) {
  int64_t bytes = 0;
  if (numel < 0 || __builtin_mul_overflow(numel, static_cast<int64_t>(dtype_size(dtype)), &bytes))
    return -1;
  return bytes;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
  return out.str();
}

// The safetensors spellings dstrain reads (dtype.h's parse_dtype also takes flag spellings,
// which a file must not use).
bool parse_file_dtype(const std::string& name, DType* dtype) {
  for (DType candidate : {DType::F32, DType::F16, DType::BF16, DType::I32}) {
    if (name == dtype_name(candidate)) {
      *dtype = candidate;
      return true;
    }
  }
  return false;
}

// A parse error of nlohmann without its "[json.exception.parse_error.101] " prefix, and
// short: the "last read" part may quote garbage of a corrupt file.
std::string json_error_text(const nlohmann::json::exception& error) {
  std::string text = error.what();
  const size_t prefix_end = text.find("] ");
  if (text.rfind("[json.exception.", 0) == 0 && prefix_end != std::string::npos)
    text = text.substr(prefix_end + 2);
  if (text.size() > 200) text = text.substr(0, 200) + "...";
  return text;
}

uint64_t load_le64(const uint8_t* bytes) {
  uint64_t value;
  std::memcpy(&value, bytes, 8);
  return value;
}

// Parses the header JSON. nlohmann keeps the last of duplicate keys; the callback sees every
// key first, so duplicates (two tensors of one name, or a field given twice) are caught.
ordered_json parse_header(const fs::path& path, std::string_view text) {
  std::vector<std::unordered_set<std::string>> keys_of_open_objects;
  std::string duplicate_key;
  auto watch_keys = [&](int /*depth*/, nlohmann::json::parse_event_t event,
                        ordered_json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) {
      keys_of_open_objects.emplace_back();
    } else if (event == Event::object_end) {
      if (!keys_of_open_objects.empty()) keys_of_open_objects.pop_back();
    } else if (event == Event::key && !keys_of_open_objects.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!keys_of_open_objects.back().insert(key).second && duplicate_key.empty()) {
        duplicate_key = key;
      }
    }
    return true;
  };
  ordered_json header;
  try {
    header = ordered_json::parse(text.begin(), text.end(), watch_keys);
  } catch (const nlohmann::json::exception& error) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "its header is not valid JSON ("
                                      << json_error_text(error) << ").";
  }
  if (!duplicate_key.empty()) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "its header has the key '" << duplicate_key
                                      << "' twice.";
  }
  if (!header.is_object()) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "its header is JSON but not an object.";
  }
  return header;
}

// A non-negative JSON integer that fits int64 (nlohmann stores those as number_unsigned).
bool as_count(const ordered_json& value, int64_t* out) {
  if (!value.is_number_unsigned()) return false;
  const uint64_t count = value.get<uint64_t>();
  if (count > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = static_cast<int64_t>(count);
  return true;
}

// Reads and checks one tensor entry of the header; `data_size` is the data buffer length.
SafetensorsTensorInfo parse_entry(const fs::path& path, const std::string& name,
                                  const ordered_json& entry, uint64_t data_size) {
  SafetensorsTensorInfo info;
  info.name = name;
  if (!entry.is_object()) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "the header entry '" << name
                                      << "' is not an object with dtype, shape and data_offsets.";
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!entry.contains(field)) {
      DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has no " << field << ".";
    }
  }

  const ordered_json& dtype = entry.at("dtype");
  if (!dtype.is_string()) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has a dtype that is not a "
                                      << "string (" << dtype.dump() << ").";
  }
  if (!parse_file_dtype(dtype.get<std::string>(), &info.dtype)) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has dtype '"
                                      << dtype.get<std::string>()
                                      << "', which dstrain does not read (it reads F32, F16, "
                                      << "BF16 and I32).";
  }

  const ordered_json& shape = entry.at("shape");
  if (!shape.is_array()) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has a shape that is not a "
                                      << "list (" << shape.dump() << ").";
  }
  for (const ordered_json& dim : shape) {
    int64_t size = 0;
    if (!as_count(dim, &size)) {
      DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has shape " << shape.dump()
                                        << ", whose dims are not all non-negative integers.";
    }
    info.shape.push_back(size);
  }
  const int64_t nbytes = checked_nbytes(checked_numel(info.shape), info.dtype);
  if (nbytes < 0) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has shape " << shape.dump()
                                      << ", too large to address.";
  }
  info.nbytes = static_cast<uint64_t>(nbytes);

  const ordered_json& offsets = entry.at("data_offsets");
  int64_t begin = 0;
  int64_t end = 0;
  if (!offsets.is_array() || offsets.size() != 2 || !as_count(offsets[0], &begin) ||
      !as_count(offsets[1], &end)) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has data_offsets "
                                      << offsets.dump() << ", not two non-negative integers.";
  }
  if (begin > end) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has data_offsets [" << begin
                                      << ", " << end << "], whose begin is after its end.";
  }
  if (static_cast<uint64_t>(end - begin) != info.nbytes) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' has shape "
                                      << info.shape_str() << ", which needs " << info.nbytes
                                      << " bytes, but its data_offsets [" << begin << ", " << end
                                      << "] hold " << end - begin << ".";
  }
  if (static_cast<uint64_t>(end) > data_size) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << name << "' ends at byte " << end
                                      << ", past the end of the " << data_size
                                      << "-byte data buffer (is the file truncated?).";
  }
  info.offset = static_cast<uint64_t>(begin);
  return info;
}

// The tensors must tile the data buffer: sorted by offset, each starts where the previous
// ended, and the last ends at the buffer's end (what the reference implementation requires).
void check_tiling(const fs::path& path, std::vector<SafetensorsTensorInfo>& infos,
                  uint64_t data_size) {
  std::stable_sort(infos.begin(), infos.end(), [](const auto& a, const auto& b) {
    if (a.offset != b.offset) return a.offset < b.offset;
    return a.offset + a.nbytes < b.offset + b.nbytes;
  });
  uint64_t covered_until = 0;
  const std::string* last_nonempty = nullptr;  // the tensor that ends at covered_until
  for (const SafetensorsTensorInfo& info : infos) {
    if (info.offset < covered_until) {
      DSTRAIN_INVALID_SAFETENSORS(path) << "tensor '" << info.name << "' (bytes ["
                                        << info.offset << ", " << info.offset + info.nbytes
                                        << ")) overlaps tensor '" << *last_nonempty << "'.";
    }
    if (info.offset > covered_until) {
      DSTRAIN_INVALID_SAFETENSORS(path) << "bytes [" << covered_until << ", " << info.offset
                                        << ") of the data buffer belong to no tensor.";
    }
    covered_until = info.offset + info.nbytes;
    if (info.nbytes > 0) last_nonempty = &info.name;
  }
  if (covered_until != data_size) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "the last " << data_size - covered_until << " of its "
                                      << data_size << " data bytes belong to no tensor.";
  }
}

}  // namespace

int64_t SafetensorsTensorInfo::numel() const { return checked_numel(shape); }

std::string SafetensorsTensorInfo::shape_str() const {
  return shape_text(shape) + " " + dtype_name(dtype);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::add_entry(std::string name, DType dtype, std::vector<int64_t> shape,
                                  const void* data, std::vector<uint8_t>* owned_bytes,
                                  bool header_only) {
  // Everything is checked before the entry exists: a failed add leaves the writer unchanged.
  DSTRAIN_CHECK(name != "__metadata__") << "'__metadata__' is reserved in safetensors";
  DSTRAIN_CHECK(!names_.contains(name)) << "tensor '" << name << "' added twice";
  for (int64_t dim : shape) DSTRAIN_CHECK(dim >= 0) << "tensor '" << name << "' dim " << dim;
  const int64_t nbytes = checked_nbytes(checked_numel(shape), dtype);
  DSTRAIN_CHECK(nbytes >= 0) << "tensor '" << name << "' of shape " << shape_text(shape)
                             << " is too large";
  if (owned_bytes != nullptr) {
    DSTRAIN_CHECK(owned_bytes->size() == static_cast<uint64_t>(nbytes))
        << "tensor '" << name << "' of shape " << shape_text(shape) << " " << dtype_name(dtype)
        << " needs " << nbytes << " bytes, got " << owned_bytes->size();
  } else if (!header_only) {
    DSTRAIN_CHECK(data != nullptr || nbytes == 0) << "tensor '" << name << "' has no data";
  }
  names_.insert(name);
  Entry& entry = entries_.emplace_back();
  entry.info.name = std::move(name);
  entry.info.dtype = dtype;
  entry.info.shape = std::move(shape);
  entry.info.offset = data_bytes_;
  entry.info.nbytes = static_cast<uint64_t>(nbytes);
  entry.data = data;
  entry.header_only = header_only;
  has_header_only_ = has_header_only_ || header_only;
  if (owned_bytes != nullptr) {
    entry.owns_bytes = true;
    entry.bytes = std::move(*owned_bytes);
  }
  data_bytes_ += entry.info.nbytes;
}

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            const void* data) {
  add_entry(std::move(name), dtype, std::move(shape), data, nullptr);
}

void SafetensorsWriter::describe(std::string name, DType dtype, std::vector<int64_t> shape) {
  add_entry(std::move(name), dtype, std::move(shape), nullptr, nullptr, true);
}

std::vector<SafetensorsTensorInfo> SafetensorsWriter::infos() const {
  std::vector<SafetensorsTensorInfo> result;
  for (const Entry& entry : entries_) result.push_back(entry.info);
  return result;
}

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            std::vector<uint8_t> bytes) {
  add_entry(std::move(name), dtype, std::move(shape), nullptr, &bytes);
}

void SafetensorsWriter::add(std::string name, const Tensor& tensor) {
  DSTRAIN_CHECK(tensor.device.is_cpu()) << "tensor '" << name << "' is on "
                                        << tensor.device.str() << "; copy it to the host first";
  std::vector<int64_t> shape(tensor.shape.begin(), tensor.shape.begin() + tensor.ndim);
  add(std::move(name), tensor.dtype, std::move(shape), static_cast<const void*>(tensor.data));
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::string SafetensorsWriter::header_bytes() const {
  ordered_json header = ordered_json::object();
  if (!metadata_.empty()) {
    ordered_json metadata = ordered_json::object();
    for (const auto& [key, value] : metadata_) metadata[key] = value;
    header["__metadata__"] = std::move(metadata);
  }
  for (const Entry& entry : entries_) {
    ordered_json fields = ordered_json::object();
    fields["dtype"] = dtype_name(entry.info.dtype);
    fields["shape"] = ordered_json::array();
    for (int64_t dim : entry.info.shape) fields["shape"].push_back(dim);
    fields["data_offsets"] = ordered_json::array({entry.info.offset,
                                                  entry.info.offset + entry.info.nbytes});
    header[entry.info.name] = std::move(fields);
  }
  std::string json;
  try {
    json = header.dump();
  } catch (const nlohmann::json::exception& error) {
    DSTRAIN_CHECK(false) << "a tensor name or metadata string is not UTF-8: " << error.what();
  }
  // Spaces up to a multiple of 8, so the data buffer (at 8 + N) starts 8-byte aligned.
  json.append((8 - json.size() % 8) % 8, ' ');
  const uint64_t length = json.size();
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &length, 8);
  return bytes + json;
}

uint64_t SafetensorsWriter::file_size() const { return header_bytes().size() + data_bytes_; }

void SafetensorsWriter::write(const fs::path& path) const {
  DSTRAIN_CHECK(!has_header_only_) << "write() of a writer with described-only tensors: "
                                   << "their data is written elsewhere";
  AtomicFileWriter out(path);
  out.write(header_bytes());
  for (const Entry& entry : entries_) out.write(entry.bytes_begin(), entry.info.nbytes);
  out.commit();
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::Impl {
  MappedFile file;
  uint64_t header_size = 0;
  const uint8_t* data_buffer = nullptr;  // file.data() + 8 + header_size
  std::vector<SafetensorsTensorInfo> infos;        // file order
  std::vector<std::string> names;                  // file order
  std::map<std::string, size_t, std::less<>> index;  // name -> position in infos
  std::map<std::string, std::string> metadata;

  // Aligned copies of tensors whose bytes in the file are not aligned (see tensor()).
  mutable std::mutex aligned_copies_mutex;
  mutable std::map<std::string, std::vector<uint64_t>, std::less<>> aligned_copies;

  const SafetensorsTensorInfo& find(std::string_view name) const {
    auto it = index.find(name);
    if (it == index.end()) {
      DSTRAIN_USER_ERROR() << "'" << file.path().string() << "' has no tensor named '" << name
                           << "'.";
    }
    return infos[it->second];
  }
};

SafetensorsFile::SafetensorsFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  auto impl = std::make_unique<Impl>();
  impl->file = MappedFile::open(path);
  const uint64_t file_size = impl->file.size();
  if (file_size < 8) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "it is " << file_size << " bytes long, shorter than "
                                      << "the 8-byte header length (is it truncated?).";
  }
  const uint64_t header_size = load_le64(impl->file.data());
  if (header_size > kSafetensorsMaxHeaderBytes) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "its header length is " << header_size
                                      << " bytes, more than the limit of "
                                      << kSafetensorsMaxHeaderBytes << ".";
  }
  if (header_size > file_size - 8) {
    DSTRAIN_INVALID_SAFETENSORS(path) << "its header length of " << header_size
                                      << " bytes runs past the end of the " << file_size
                                      << "-byte file (is it truncated?).";
  }
  impl->header_size = header_size;
  impl->data_buffer = impl->file.data() + 8 + header_size;
  const uint64_t data_size = file_size - 8 - header_size;

  const std::string_view text(reinterpret_cast<const char*>(impl->file.data() + 8), header_size);
  const ordered_json header = parse_header(path, text);
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;  // the reference implementation reads null as absent
      if (!value.is_object()) {
        DSTRAIN_INVALID_SAFETENSORS(path) << "its __metadata__ is not an object of strings.";
      }
      for (const auto& [meta_key, meta_value] : value.items()) {
        if (!meta_value.is_string()) {
          DSTRAIN_INVALID_SAFETENSORS(path) << "its __metadata__ entry '" << meta_key
                                            << "' is not a string (" << meta_value.dump()
                                            << ").";
        }
        impl->metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    impl->infos.push_back(parse_entry(path, key, value, data_size));
  }
  check_tiling(path, impl->infos, data_size);
  for (size_t i = 0; i < impl->infos.size(); ++i) {
    impl->names.push_back(impl->infos[i].name);
    impl->index.emplace(impl->infos[i].name, i);
  }
  return SafetensorsFile(std::move(impl));
}

const fs::path& SafetensorsFile::path() const { return impl_->file.path(); }
const std::vector<std::string>& SafetensorsFile::names() const { return impl_->names; }
bool SafetensorsFile::contains(std::string_view name) const {
  return impl_->index.find(name) != impl_->index.end();
}
const SafetensorsTensorInfo& SafetensorsFile::info(std::string_view name) const {
  return impl_->find(name);
}
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_->metadata;
}
uint64_t SafetensorsFile::header_size() const { return impl_->header_size; }

const void* SafetensorsFile::data(std::string_view name) const {
  return impl_->data_buffer + impl_->find(name).offset;
}

Tensor SafetensorsFile::tensor(std::string_view name) const {
  const SafetensorsTensorInfo& info = impl_->find(name);
  DSTRAIN_USER_CHECK(info.shape.size() <= static_cast<size_t>(kMaxDims))
      << "tensor '" << info.name << "' in '" << path().string() << "' has "
      << info.shape.size() << " dims; dstrain tensors have at most " << kMaxDims << ".";
  const uint8_t* bytes = impl_->data_buffer + info.offset;
  // An empty tensor's pointer is never dereferenced: no copy needed.
  if (info.nbytes > 0 && reinterpret_cast<uintptr_t>(bytes) % dtype_size(info.dtype) != 0) {
    std::lock_guard<std::mutex> lock(impl_->aligned_copies_mutex);
    auto it = impl_->aligned_copies.find(info.name);
    if (it == impl_->aligned_copies.end()) {
      std::vector<uint64_t> copy((info.nbytes + 7) / 8);
      std::memcpy(copy.data(), bytes, info.nbytes);
      it = impl_->aligned_copies.emplace(info.name, std::move(copy)).first;
    }
    bytes = reinterpret_cast<const uint8_t*>(it->second.data());
  }
  Tensor view;
  view.data = const_cast<uint8_t*>(bytes);  // read-only memory; see the header
  view.dtype = info.dtype;
  view.ndim = static_cast<int>(info.shape.size());
  for (int d = 0; d < view.ndim; ++d) view.shape[d] = info.shape[d];
  view.device = Device{};
  return view;
}

void SafetensorsFile::read_f32(std::string_view name, float* dst, int64_t count) const {
  const SafetensorsTensorInfo& info = impl_->find(name);
  DSTRAIN_USER_CHECK(count == info.numel())
      << "tensor '" << info.name << "' in '" << path().string() << "' has shape "
      << info.shape_str() << " (" << info.numel() << " elements), but " << count
      << " were expected.";
  const uint8_t* bytes = impl_->data_buffer + info.offset;
  switch (info.dtype) {
    case DType::F32:
      if (info.nbytes > 0) std::memcpy(dst, bytes, info.nbytes);
      return;
    case DType::F16:
    case DType::BF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);  // may be unaligned
        dst[i] = info.dtype == DType::F16 ? fp16_bits_to_fp32(bits) : bf16_bits_to_fp32(bits);
      }
      return;
    case DType::I32:
    case DType::F8E4M3:  // never parsed from a file (parse_file_dtype)
    case DType::F8E5M2:
      break;
  }
  DSTRAIN_USER_ERROR() << "tensor '" << info.name << "' in '" << path().string() << "' is "
                       << dtype_name(info.dtype) << ", not a floating-point tensor.";
}

std::vector<float> SafetensorsFile::read_f32(std::string_view name) const {
  std::vector<float> values(static_cast<size_t>(info(name).numel()));
  read_f32(name, values.data(), static_cast<int64_t>(values.size()));
  return values;
}

#undef DSTRAIN_INVALID_SAFETENSORS

}  // namespace dstrain
