// Loss masks: which tokens of a shard the loss trains, and where each conversation begins (chat
// data written by `dstrain prepare --chat`).
//
// The mask of the token shard `X.bin` is the file `X.mask` beside it (of any other token file
// NAME, `NAME.mask`). A mask file is a header of 256 little-endian int32 (as an llm.c shard):
//   header[0] magic 20261127, header[1] version 1, header[2] the shard's token count, the rest 0
// then one byte per token of the shard:
//   bit 0 (kMaskTrained): the loss counts this token as a target (the prediction of it from
//     the tokens before it is trained)
//   bit 1 (kMaskConversationStart): a conversation begins at this token (its first token)
//   the other bits are 0.
// A shard with a mask starts with a conversation (its first byte has bit 1), so no conversation
// spans two shards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/fs.h"

namespace dstrain {

constexpr int32_t kMaskMagic = 20261127;
constexpr int32_t kMaskVersion = 1;
constexpr uint8_t kMaskTrained = 1;
constexpr uint8_t kMaskConversationStart = 2;

// X.bin -> X.mask; any other name -> NAME.mask.
std::string mask_path_for(const std::string& token_path);

// A mask file, memory-mapped.
struct MappedMask {
  MappedFile file;
  const uint8_t* bytes = nullptr;  // (count) flags
  size_t count = 0;
};

// Opens and checks a mask file. Throws UserError naming the file when it is shorter than the
// header, its magic or version is not a mask's, its count differs from `token_count` (the
// shard's) or from its size, a byte has a bit other than bits 0-1, or its first byte does not
// begin a conversation.
MappedMask open_mask_file(const std::string& path, size_t token_count);

// Streaming writer, as TokenFileWriter: the count is given up front, the file appears (atomically)
// on commit(); a writer destroyed without commit() removes its temporary file.
class MaskFileWriter {
 public:
  // Throws UserError when the count does not fit the header or the file cannot be created.
  MaskFileWriter(const std::string& path, size_t token_count);
  // REQUIRES: written() + flags.size() <= token_count, every flag <= 3, not committed.
  void append(std::span<const uint8_t> flags);
  size_t written() const { return written_; }
  // REQUIRES: written() == token_count.
  void commit();

 private:
  std::string path_;
  size_t token_count_;
  size_t written_ = 0;
  AtomicFileWriter file_;
};

void write_mask_file(const std::string& path, std::span<const uint8_t> flags);

}  // namespace dstrain
