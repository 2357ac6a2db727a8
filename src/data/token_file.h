// Token files: the llm.c shard format and raw uint16/uint32 token files.
//
// llm.c shard: a header of 256 little-endian int32, then the tokens.
//   header[0] magic, header[1] version, header[2] number of tokens (the rest is zero)
//   magic 20240520, version 1: uint16 tokens (GPT-2 and other vocabularies < 65536)
//   magic 20240801, version 7: uint32 tokens
// Raw token file: a name ending in ".u16" or ".u32", bare little-endian tokens, no header.
// Any other name is read as an llm.c shard.
//
// A TokenSource is the immutable token sequence of one file (memory-mapped, so corpora larger
// than RAM work) or of an in-memory vector (the synthetic corpus). Every token is checked
// against the caller's vocabulary size when the source is made, so nothing read later can
// index past an embedding table. A TokenSource never changes after it is made, so rank threads
// may share one and read it concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/fs.h"
#include "data/loss_mask.h"

namespace dstrain {

enum class TokenFormat : uint8_t {
  kLlmcU16,  // llm.c header, magic 20240520 version 1, uint16 tokens
  kLlmcU32,  // llm.c header, magic 20240801 version 7, uint32 tokens
  kRawU16,   // no header, uint16 tokens; the file name must end in ".u16"
  kRawU32,   // no header, uint32 tokens; the file name must end in ".u32"
};

constexpr int32_t kLlmcMagicU16 = 20240520;
constexpr int32_t kLlmcVersionU16 = 1;
constexpr int32_t kLlmcMagicU32 = 20240801;
constexpr int32_t kLlmcVersionU32 = 7;
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);  // 1024

const char* token_format_name(TokenFormat format);  // "llm.c uint16", "raw uint32", ...
size_t token_width(TokenFormat format);              // bytes per token: 2 or 4
// True when the name ends in ".u16" or ".u32" (a raw token file). Only the raw-or-not
// decision is taken from the name; an llm.c shard's token width is in its header.
bool is_raw_token_path(const std::string& path);

class TokenSource {
 public:
  // Opens a token file read-only and memory-maps it (core/fs.h MappedFile, which reads the
  // file into memory where mmap is refused). Throws UserError, naming the file, when it is
  // missing, a directory, empty, shorter than the header, its header's token count disagrees
  // with its size (truncated or trailing bytes), the magic is not an llm.c magic, the version
  // is not the one of that magic, a raw file's size is not a multiple of the token width, or
  // a token id is >= vocab_size (the message names the first such id and its position; the
  // check is one linear scan of the file at open time).
  // When the loss mask of the file (mask_path_for, data/loss_mask.h) exists, it is opened
  // and checked too (open_mask_file's errors).
  // REQUIRES: the file is not truncated while the source lives (the mapping would fault).
  // REQUIRES: vocab_size > 0.
  static std::shared_ptr<const TokenSource> open_file(const std::string& path, int64_t vocab_size);

  // An in-memory source (synthetic data, tests). Same id check as open_file; `name` appears
  // in error messages. `mask`: none, or one flag byte per token as a mask file holds them
  // (checked as open_mask_file checks them). REQUIRES: vocab_size > 0.
  static std::shared_ptr<const TokenSource> from_tokens(std::vector<int32_t> tokens,
                                                        int64_t vocab_size,
                                                        std::string name = "in-memory tokens",
                                                        std::vector<uint8_t> mask = {});

  TokenSource(const TokenSource&) = delete;
  TokenSource& operator=(const TokenSource&) = delete;

  size_t size() const { return count_; }
  const std::string& name() const { return name_; }

  // The token at position i. REQUIRES: i < size().
  int32_t token(size_t i) const;
  // Copies tokens [begin, begin + count) to out as int32. REQUIRES: begin + count <= size().
  void read(size_t begin, size_t count, int32_t* out) const;

  // The loss mask's flags (size() bytes: kMaskTrained, kMaskConversationStart), or empty when
  // the source has no mask (text).
  std::span<const uint8_t> mask() const { return {mask_flags_, mask_flags_ ? count_ : 0}; }

 private:
  enum class Storage : uint8_t { kU16, kU32, kI32 };
  TokenSource() = default;
  void check_vocab(int64_t vocab_size) const;

  std::string name_;
  Storage storage_ = Storage::kI32;
  const void* tokens_ = nullptr;       // (count_,) of the storage type
  size_t count_ = 0;
  MappedFile file_;                    // open_file: the whole file, header included
  std::vector<int32_t> owned_tokens_;  // from_tokens
  const uint8_t* mask_flags_ = nullptr;  // (count_) or none
  MappedMask mask_file_;                 // open_file with a mask
  std::vector<uint8_t> owned_mask_;      // from_tokens with a mask
};

// Writes a token file atomically (core/fs.h AtomicFileWriter): the tokens go to a hidden
// temporary file in the destination's directory, which is fsynced and then renamed over
// `path`, so a reader never sees a half-written file and a failure leaves nothing behind.
// Throws UserError when a token does not fit the format (negative, or >= 65536 for uint16),
// when the count does not fit the llm.c header's int32, when a raw format's extension does not
// match the file name, or when the file cannot be written (the message carries the OS error).
void write_token_file(const std::string& path, std::span<const int32_t> tokens, TokenFormat format);

// Streaming form of write_token_file for data larger than memory. The llm.c header comes
// first in the file, so the token count is given up front:
//   TokenFileWriter writer(path, format, token_count);
//   writer.append(chunk); ...   // chunks adding up to token_count
//   writer.commit();            // fsync, rename into place, fsync the directory
// A writer destroyed without commit() removes its temporary file.
class TokenFileWriter {
 public:
  // Throws UserError as write_token_file does (name, count, file creation).
  TokenFileWriter(const std::string& path, TokenFormat format, size_t token_count);

  // Throws UserError on a token that does not fit the format.
  // REQUIRES: tokens_written() + tokens.size() <= token_count, not committed.
  void append(std::span<const int32_t> tokens);
  size_t tokens_written() const { return written_; }
  const std::string& path() const { return path_; }
  // REQUIRES: tokens_written() == token_count.
  void commit();

 private:
  std::string path_;
  TokenFormat format_;
  size_t token_count_;
  size_t written_ = 0;
  AtomicFileWriter file_;
  std::vector<unsigned char> staging_;  // conversion buffer for append
};

// A data specification -> the sorted list of files it names. A spec with a glob metacharacter
// (* ? [) is expanded with glob(3); otherwise it is one path.
// Throws UserError naming the pattern when a glob matches nothing, or naming the path when a
// plain path does not exist or is a directory.
std::vector<std::string> expand_data_paths(const std::string& spec);

}  // namespace dstrain
