// The safetensors format (https://github.com/huggingface/safetensors), the weight format of
// dstrain's checkpoints and of Hugging Face models:
//
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  JSON object, padded with spaces:
//              {"__metadata__": {"key": "value", ...},                        (optional)
//               "wte.weight": {"dtype": "F32", "shape": [50257, 768],
//                              "data_offsets": [begin, end]}, ...}
//   [rest]     the data buffer; [begin, end) are byte offsets into it. Tensors are row-major,
//              little-endian, and tile the buffer exactly: no overlaps, no holes.
//
// dstrain reads and writes the dtypes F32, F16, BF16 and I32; any other dtype is an error
// naming it. The reader validates the whole header before anyone can touch the data, and
// every problem is a UserError with one sentence naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace dstrain {

// Headers larger than this are rejected as corrupt (the same limit as the reference
// implementation; a GPT-2 header with ~150 tensors is ~15 KB).
constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct SafetensorsTensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // [] for a scalar (one element)
  uint64_t offset = 0;         // byte offset of the first byte in the data buffer
  uint64_t nbytes = 0;         // numel() * dtype_size(dtype)

  int64_t numel() const;
  std::string shape_str() const;  // "[2, 3] F32"
};

// Collects named tensors and writes them as one safetensors file: the header padded with
// spaces to a multiple of 8 bytes (so the data buffer starts 8-byte aligned), then the
// tensors contiguous in the order they were added.
class SafetensorsWriter {
 public:
  // Keeps the pointer, not a copy: `data` must stay valid until write() returns.
  // REQUIRES: a name not added before and not "__metadata__"; every dim >= 0; data != nullptr
  // unless the tensor has no elements.
  void add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data);
  // Takes ownership of the bytes. REQUIRES: as above, and bytes.size() == numel * dtype size.
  void add(std::string name, DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes);
  // A CPU tensor's memory, kept as a pointer like the first overload.
  // REQUIRES: tensor.device.is_cpu().
  void add(std::string name, const Tensor& tensor);
  // Written under "__metadata__" (sorted by key). A later value for a key replaces the earlier.
  void set_metadata(std::string key, std::string value);
  // A tensor of the header whose data someone else writes (e.g. each rank its own part, at
  // header_bytes().size() + infos()[i].offset). A writer holding one cannot write().
  void describe(std::string name, DType dtype, std::vector<int64_t> shape);
  // Every tensor added so far, with its offset in the data buffer.
  std::vector<SafetensorsTensorInfo> infos() const;

  size_t size() const { return entries_.size(); }
  // The bytes in front of the data buffer: the 8-byte length and the padded JSON header.
  std::string header_bytes() const;
  uint64_t file_size() const;

  // Writes the file atomically (fs.h: temp file, fsync, rename, fsync the directory).
  // Throws UserError naming the path on any I/O failure; an existing file is then untouched.
  void write(const std::filesystem::path& path) const;

 private:
  struct Entry {
    SafetensorsTensorInfo info;
    const void* data = nullptr;  // borrowed, unless owns_bytes
    bool owns_bytes = false;
    bool header_only = false;    // describe(): the data is written elsewhere
    std::vector<uint8_t> bytes;  // owned
    const void* bytes_begin() const { return owns_bytes ? bytes.data() : data; }
  };
  // owned_bytes: taken when not null, else `data` is borrowed.
  void add_entry(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
                 std::vector<uint8_t>* owned_bytes, bool header_only = false);

  std::vector<Entry> entries_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_bytes_ = 0;
  bool has_header_only_ = false;
};

// A safetensors file mapped read-only (mmap) and validated. Move-only; the pointers and
// tensors it hands out stay valid while it lives.
class SafetensorsFile {
 public:
  // Maps `path` and checks, before returning: the length prefix fits the file and is at most
  // kSafetensorsMaxHeaderBytes; the header is a JSON object without duplicate keys; each
  // entry has a known dtype, a shape of non-negative integers and two integer data_offsets
  // with begin <= end, end - begin == numel * dtype size; the tensors tile the data buffer
  // exactly (no overlap, no hole, nothing past its end); __metadata__ maps strings to strings.
  // Throws UserError with one sentence naming the file and the problem.
  static SafetensorsFile open(const std::filesystem::path& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::filesystem::path& path() const;
  // Tensor names in file order: the order of their bytes in the data buffer.
  const std::vector<std::string>& names() const;
  bool contains(std::string_view name) const;
  // Throws UserError naming the file when it holds no tensor `name` (so does every accessor).
  const SafetensorsTensorInfo& info(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const;
  uint64_t header_size() const;  // N, the JSON header length (the data buffer starts at 8 + N)

  // The tensor's bytes in the mapping. May be unaligned: the format does not align tensors.
  const void* data(std::string_view name) const;
  // A CPU view of the tensor. Where the bytes in the file are not aligned to the dtype size,
  // the view points at an aligned copy owned by this object. READ-ONLY: the memory is mapped
  // without write permission, writing through the view crashes.
  // Throws UserError for a tensor of more than kMaxDims dims.
  Tensor tensor(std::string_view name) const;
  // Converts an F32, F16 or BF16 tensor to fp32 into dst[0, count).
  // Throws UserError naming the file and tensor when count != numel or the dtype is I32.
  void read_f32(std::string_view name, float* dst, int64_t count) const;
  std::vector<float> read_f32(std::string_view name) const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dstrain
