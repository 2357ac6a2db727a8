#include "data/loss_mask.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "data/token_file.h"

namespace dstrain {

std::string mask_path_for(const std::string& token_path) {
  constexpr std::string_view kBin = ".bin";
  if (token_path.size() > kBin.size() &&
      token_path.compare(token_path.size() - kBin.size(), kBin.size(), kBin) == 0) {
    return token_path.substr(0, token_path.size() - kBin.size()) + ".mask";
  }
  return token_path + ".mask";
}

MappedMask open_mask_file(const std::string& path, size_t token_count) {
  MappedMask mask;
  mask.file = MappedFile::open(path);
  const size_t size = mask.file.size();
  DSTRAIN_USER_CHECK(size >= kLlmcHeaderBytes)
      << "loss mask '" << path << "' is " << size << " bytes, shorter than its " << kLlmcHeaderBytes
      << "-byte header; it is truncated.";
  int32_t header[3];
  std::memcpy(header, mask.file.data(), sizeof(header));
  DSTRAIN_USER_CHECK(header[0] == kMaskMagic && header[1] == kMaskVersion)
      << "'" << path << "' is not a dstrain loss mask (magic " << header[0] << " version "
      << header[1] << "; expected " << kMaskMagic << " version " << kMaskVersion << ").";
  DSTRAIN_USER_CHECK(header[2] >= 0 && static_cast<size_t>(header[2]) == token_count)
      << "loss mask '" << path << "' counts " << header[2] << " tokens but its token shard holds "
      << token_count << "; the two files do not belong together (prepare the data again).";
  DSTRAIN_USER_CHECK(size - kLlmcHeaderBytes == token_count)
      << "loss mask '" << path << "' holds " << size - kLlmcHeaderBytes
      << " bytes after its header for " << token_count << " tokens; it is truncated or corrupt.";
  mask.bytes = mask.file.data() + kLlmcHeaderBytes;
  mask.count = token_count;
  const uint8_t* bad =
      std::find_if(mask.bytes, mask.bytes + token_count, [](uint8_t flags) { return flags > 3; });
  DSTRAIN_USER_CHECK(bad == mask.bytes + token_count)
      << "loss mask '" << path << "' has the byte " << int{*bad} << " at token " << bad - mask.bytes
      << "; only bits 0 (trained) and 1 (conversation start) are defined.";
  DSTRAIN_USER_CHECK(token_count == 0 || (mask.bytes[0] & kMaskConversationStart) != 0)
      << "loss mask '" << path << "' does not begin a conversation at its first token; a "
      << "conversation may not span two shards.";
  return mask;
}

MaskFileWriter::MaskFileWriter(const std::string& path, size_t token_count)
    : path_(path), token_count_(token_count), file_(path) {
  DSTRAIN_USER_CHECK(token_count <= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
      << "too many tokens (" << token_count << ") for one loss mask '" << path << "'.";
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = kMaskMagic;
  header[1] = kMaskVersion;
  header[2] = static_cast<int32_t>(token_count);
  file_.write(header, sizeof(header));
}

void MaskFileWriter::append(std::span<const uint8_t> flags) {
  DSTRAIN_CHECK(flags.size() <= token_count_ - written_)
      << "appending " << flags.size() << " flags to '" << path_ << "' after " << written_
      << " of the announced " << token_count_;
  DSTRAIN_CHECK(std::all_of(flags.begin(), flags.end(), [](uint8_t f) { return f <= 3; }))
      << "a loss mask flag above 3";
  file_.write(flags.data(), flags.size());
  written_ += flags.size();
}

void MaskFileWriter::commit() {
  DSTRAIN_CHECK(written_ == token_count_)
      << "'" << path_ << "' got " << written_ << " flags of the announced " << token_count_;
  file_.commit();
}

void write_mask_file(const std::string& path, std::span<const uint8_t> flags) {
  MaskFileWriter writer(path, flags.size());
  writer.append(flags);
  writer.commit();
}

}  // namespace dstrain
