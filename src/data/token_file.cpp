#include "data/token_file.h"

#include <glob.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/check.h"

namespace dstrain {

// The formats are little-endian and tokens are used in place from the mapping.
static_assert(std::endian::native == std::endian::little, "dstrain reads token files in place");

namespace {

bool ends_with(const std::string& text, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return text.size() >= n && text.compare(text.size() - n, n, suffix) == 0;
}

// The first position whose token, seen as unsigned, is >= vocab_size; `count` when none.
// Scans in chunks with a branch-free max so the common all-valid case runs at memory speed.
template <class U>
size_t first_token_at_or_above(const U* tokens, size_t count, uint64_t vocab_size) {
  constexpr size_t kChunk = 1 << 16;
  for (size_t begin = 0; begin < count; begin += kChunk) {
    const size_t end = std::min(count, begin + kChunk);
    U chunk_max = 0;
    for (size_t i = begin; i < end; ++i) chunk_max = std::max(chunk_max, tokens[i]);
    if (static_cast<uint64_t>(chunk_max) < vocab_size) continue;
    for (size_t i = begin; i < end; ++i)
      if (static_cast<uint64_t>(tokens[i]) >= vocab_size) return i;
  }
  return count;
}

template <class U>
void widen(const U* tokens, size_t count, int32_t* out) {
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<int32_t>(tokens[i]);
}

}  // namespace

const char* token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::kLlmcU16: return "llm.c uint16";
    case TokenFormat::kLlmcU32: return "llm.c uint32";
    case TokenFormat::kRawU16: return "raw uint16";
    case TokenFormat::kRawU32: return "raw uint32";
  }
  return "unknown";
}

size_t token_width(TokenFormat format) {
  return (format == TokenFormat::kLlmcU16 || format == TokenFormat::kRawU16) ? 2 : 4;
}

namespace {

// Whether the first bytes read as UTF-8 text (printable characters and whitespace, no NUL):
// what a token shard never is, since its header and small ids hold zero bytes.
bool looks_like_text(const unsigned char* bytes, size_t size) {
  const size_t n = std::min<size_t>(size, 4096);
  size_t i = 0;
  while (i < n) {
    const unsigned char c = bytes[i];
    if (c < 0x80) {
      if (c < 0x20 && c != '\n' && c != '\r' && c != '\t' && c != '\f') return false;
      ++i;
      continue;
    }
    const size_t length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (length == 0 || c > 0xF4) return false;
    for (size_t k = 1; k < length; ++k) {
      if (i + k >= n) return true;  // a character cut by the sample's end
      if ((bytes[i + k] & 0xC0) != 0x80) return false;
    }
    i += length;
  }
  return true;
}

}  // namespace

bool is_raw_token_path(const std::string& path) {
  return ends_with(path, ".u16") || ends_with(path, ".u32");
}

// ---------------------------------------------------------------------------------------------
// TokenSource

std::shared_ptr<const TokenSource> TokenSource::open_file(const std::string& path,
                                                          int64_t vocab_size) {
  DSTRAIN_CHECK(vocab_size > 0) << "vocab_size " << vocab_size;
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  DSTRAIN_USER_CHECK(fs::exists(status)) << "token file '" << path << "' does not exist.";
  DSTRAIN_USER_CHECK(!fs::is_directory(status))
      << "'" << path << "' is a directory, not a token file; give a file or a glob such as '"
      << path << "/*.bin'.";

  std::shared_ptr<TokenSource> source(new TokenSource());
  source->name_ = path;
  source->file_ = MappedFile::open(path);
  const unsigned char* bytes = source->file_.data();
  const size_t file_bytes = source->file_.size();
  DSTRAIN_USER_CHECK(file_bytes > 0) << "token file '" << path << "' is empty (0 bytes).";
  DSTRAIN_USER_CHECK(is_raw_token_path(path) || !looks_like_text(bytes, file_bytes))
      << "'" << path << "' holds text, not tokens: tokenize it first with `dstrain prepare "
      << "--input " << path << " --out DIR` (add --tokenizer tokenizer.json for a Hugging Face "
      << "model), then train with --data 'DIR/train_*.bin'.";

  if (is_raw_token_path(path)) {
    const bool u16 = ends_with(path, ".u16");
    const size_t width = u16 ? 2 : 4;
    source->storage_ = u16 ? Storage::kU16 : Storage::kU32;
    DSTRAIN_USER_CHECK(file_bytes % width == 0)
        << "raw token file '" << path << "' is " << file_bytes << " bytes, not a multiple of "
        << width << " bytes per " << (u16 ? "uint16" : "uint32")
        << " token; it is truncated or has the wrong extension.";
    source->count_ = file_bytes / width;
    source->tokens_ = bytes;
  } else {
    DSTRAIN_USER_CHECK(file_bytes >= kLlmcHeaderBytes)
        << "token file '" << path << "' is " << file_bytes << " bytes, shorter than the "
        << kLlmcHeaderBytes << "-byte llm.c header; it is truncated or not a token shard "
        << "(raw token files must end in .u16 or .u32).";
    int32_t header[3];  // magic, version, count
    std::memcpy(header, bytes, sizeof(header));
    const int32_t magic = header[0], version = header[1], count = header[2];
    DSTRAIN_USER_CHECK(magic != kMaskMagic)
        << "'" << path << "' is the loss mask of a chat shard, not a token shard; name the "
        << "shards alone (--data 'DIR/train_*.bin'): their masks are found beside them.";
    DSTRAIN_USER_CHECK(magic == kLlmcMagicU16 || magic == kLlmcMagicU32)
        << "token file '" << path << "' has magic number " << magic
        << ", so it is not an llm.c token shard (expected " << kLlmcMagicU16 << " for uint16 or "
        << kLlmcMagicU32 << " for uint32 tokens); raw token files must end in .u16 or .u32.";
    const bool u16 = magic == kLlmcMagicU16;
    const int32_t supported_version = u16 ? kLlmcVersionU16 : kLlmcVersionU32;
    DSTRAIN_USER_CHECK(version == supported_version)
        << "token file '" << path << "' has the " << (u16 ? "uint16" : "uint32") << " magic "
        << magic << " with version " << version << "; only version " << supported_version
        << " is supported for it.";
    const size_t width = u16 ? 2 : 4;
    source->storage_ = u16 ? Storage::kU16 : Storage::kU32;
    DSTRAIN_USER_CHECK(count >= 0) << "token file '" << path << "' has a negative token count ("
                                   << count << ") in its header; it is corrupt.";
    const size_t data_bytes = file_bytes - kLlmcHeaderBytes;
    const size_t expected_bytes = static_cast<size_t>(count) * width;
    DSTRAIN_USER_CHECK(data_bytes >= expected_bytes)
        << "token file '" << path << "' is truncated: its header says " << count
        << " tokens (" << expected_bytes << " bytes after the header) but it holds only "
        << data_bytes << " bytes after the header.";
    DSTRAIN_USER_CHECK(data_bytes == expected_bytes)
        << "token file '" << path << "' has " << (data_bytes - expected_bytes)
        << " trailing bytes after the " << count
        << " tokens its header announces; it is corrupt or was written by another tool.";
    source->count_ = static_cast<size_t>(count);
    source->tokens_ = bytes + kLlmcHeaderBytes;  // 4-byte aligned: the mapping is page aligned
  }
  source->check_vocab(vocab_size);
  const std::string mask_path = mask_path_for(path);
  if (std::filesystem::exists(mask_path)) {
    source->mask_file_ = open_mask_file(mask_path, source->count_);
    source->mask_flags_ = source->mask_file_.bytes;
  }
  return source;
}

std::shared_ptr<const TokenSource> TokenSource::from_tokens(std::vector<int32_t> tokens,
                                                            int64_t vocab_size, std::string name,
                                                            std::vector<uint8_t> mask) {
  DSTRAIN_CHECK(vocab_size > 0) << "vocab_size " << vocab_size;
  std::shared_ptr<TokenSource> source(new TokenSource());
  source->name_ = std::move(name);
  source->storage_ = Storage::kI32;
  source->owned_tokens_ = std::move(tokens);
  source->count_ = source->owned_tokens_.size();
  source->tokens_ = source->owned_tokens_.data();
  source->check_vocab(vocab_size);
  if (!mask.empty()) {
    DSTRAIN_CHECK(mask.size() == source->count_ &&
                  std::all_of(mask.begin(), mask.end(), [](uint8_t f) { return f <= 3; }) &&
                  (mask[0] & kMaskConversationStart) != 0)
        << "the loss mask of '" << source->name_ << "': " << mask.size() << " flags for "
        << source->count_ << " tokens, each at most 3, the first starting a conversation";
    source->owned_mask_ = std::move(mask);
    source->mask_flags_ = source->owned_mask_.data();
  }
  return source;
}

void TokenSource::check_vocab(int64_t vocab_size) const {
  const uint64_t vocab = static_cast<uint64_t>(vocab_size);
  size_t bad = count_;
  switch (storage_) {
    case Storage::kU16:
      bad = first_token_at_or_above(static_cast<const uint16_t*>(tokens_), count_, vocab);
      break;
    case Storage::kU32:
      bad = first_token_at_or_above(static_cast<const uint32_t*>(tokens_), count_, vocab);
      break;
    case Storage::kI32:  // seen as uint32, a negative id is huge and caught by the same test
      bad = first_token_at_or_above(reinterpret_cast<const uint32_t*>(tokens_), count_, vocab);
      break;
  }
  if (bad == count_) return;
  const int64_t id = storage_ == Storage::kU32 ? static_cast<int64_t>(
                                                     static_cast<const uint32_t*>(tokens_)[bad])
                                               : token(bad);
  DSTRAIN_USER_ERROR() << (storage_ == Storage::kI32 ? "" : "token file ") << "'" << name_
                       << "' holds token id " << id << " at position " << bad
                       << " (counting from 0), but the vocabulary has " << vocab_size
                       << " tokens (ids 0.." << vocab_size - 1
                       << "); use a vocab_size that covers the data or re-tokenize it.";
}

int32_t TokenSource::token(size_t i) const {
  DSTRAIN_CHECK(i < count_) << "token " << i << " of " << count_;
  switch (storage_) {
    case Storage::kU16: return static_cast<const uint16_t*>(tokens_)[i];
    case Storage::kU32: return static_cast<int32_t>(static_cast<const uint32_t*>(tokens_)[i]);
    case Storage::kI32: return static_cast<const int32_t*>(tokens_)[i];
  }
  return 0;
}

void TokenSource::read(size_t begin, size_t count, int32_t* out) const {
  DSTRAIN_CHECK(begin <= count_ && count <= count_ - begin)
      << "read [" << begin << ", " << begin + count << ") of " << count_ << " tokens";
  switch (storage_) {
    case Storage::kU16: widen(static_cast<const uint16_t*>(tokens_) + begin, count, out); break;
    case Storage::kU32: widen(static_cast<const uint32_t*>(tokens_) + begin, count, out); break;
    case Storage::kI32:
      std::memcpy(out, static_cast<const int32_t*>(tokens_) + begin, count * sizeof(int32_t));
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {

// Checks that a file of `format` named `path` reads back in that format.
const std::string& checked_token_path(const std::string& path, TokenFormat format) {
  if (format == TokenFormat::kRawU16 || format == TokenFormat::kRawU32) {
    const char* extension = format == TokenFormat::kRawU16 ? ".u16" : ".u32";
    DSTRAIN_USER_CHECK(ends_with(path, extension))
        << "a " << token_format_name(format) << " token file must be named *" << extension
        << ", so it reads back as one; '" << path << "' is not.";
  } else {
    DSTRAIN_USER_CHECK(!is_raw_token_path(path))
        << "'" << path << "' ends in .u16 or .u32, which names a raw token file; give an "
        << token_format_name(format) << " shard another name such as *.bin.";
  }
  return path;
}

}  // namespace

TokenFileWriter::TokenFileWriter(const std::string& path, TokenFormat format, size_t token_count)
    : path_(path),
      format_(format),
      token_count_(token_count),
      file_(checked_token_path(path, format)) {
  if (format == TokenFormat::kLlmcU16 || format == TokenFormat::kLlmcU32) {
    DSTRAIN_USER_CHECK(token_count <= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
        << "too many tokens (" << token_count << ") for one llm.c shard '" << path
        << "' (its header counts at most " << std::numeric_limits<int32_t>::max()
        << "); split the data into several shards.";
    int32_t header[kLlmcHeaderInts] = {};
    const bool u16 = format == TokenFormat::kLlmcU16;
    header[0] = u16 ? kLlmcMagicU16 : kLlmcMagicU32;
    header[1] = u16 ? kLlmcVersionU16 : kLlmcVersionU32;
    header[2] = static_cast<int32_t>(token_count);
    file_.write(header, sizeof(header));
  }
}

void TokenFileWriter::append(std::span<const int32_t> tokens) {
  DSTRAIN_CHECK(tokens.size() <= token_count_ - written_)
      << "appending " << tokens.size() << " tokens to '" << path_ << "' after " << written_
      << " of the announced " << token_count_;
  const size_t width = token_width(format_);
  const int64_t limit = width == 2 ? 65536 : int64_t{1} << 32;
  constexpr size_t kChunk = 1 << 20;
  for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
    const size_t n = std::min(kChunk, tokens.size() - begin);
    staging_.resize(n * width);
    for (size_t i = 0; i < n; ++i) {
      const int32_t t = tokens[begin + i];
      DSTRAIN_USER_CHECK(t >= 0 && t < limit)
          << "token id " << t << " at position " << written_ + begin + i << " does not fit a "
          << token_format_name(format_) << " token file '" << path_ << "'"
          << (width == 2 ? "; use a uint32 format for vocabularies of more than 65536." : ".");
      if (width == 2) {
        const uint16_t v = static_cast<uint16_t>(t);
        std::memcpy(staging_.data() + 2 * i, &v, 2);
      } else {
        const uint32_t v = static_cast<uint32_t>(t);
        std::memcpy(staging_.data() + 4 * i, &v, 4);
      }
    }
    file_.write(staging_.data(), staging_.size());
  }
  written_ += tokens.size();
}

void TokenFileWriter::commit() {
  DSTRAIN_CHECK(written_ == token_count_) << "'" << path_ << "' got " << written_
                                          << " tokens of the announced " << token_count_;
  file_.commit();
}

void write_token_file(const std::string& path, std::span<const int32_t> tokens,
                      TokenFormat format) {
  TokenFileWriter writer(path, format, tokens.size());
  writer.append(tokens);
  writer.commit();
}

// ---------------------------------------------------------------------------------------------
// Paths

std::vector<std::string> expand_data_paths(const std::string& spec) {
  DSTRAIN_USER_CHECK(!spec.empty()) << "the data path is empty; give a token file or a glob.";
  namespace fs = std::filesystem;
  if (spec.find_first_of("*?[") == std::string::npos) {
    std::error_code error;
    const fs::file_status status = fs::status(spec, error);
    DSTRAIN_USER_CHECK(fs::exists(status)) << "data file '" << spec << "' does not exist.";
    DSTRAIN_USER_CHECK(!fs::is_directory(status))
        << "data path '" << spec << "' is a directory; give a file or a glob such as '" << spec
        << "/*.bin'.";
    return {spec};
  }
  glob_t matches{};
  const int result = ::glob(spec.c_str(), 0, nullptr, &matches);
  std::vector<std::string> paths;
  if (result == 0)
    for (size_t i = 0; i < matches.gl_pathc; ++i) paths.emplace_back(matches.gl_pathv[i]);
  ::globfree(&matches);
  DSTRAIN_USER_CHECK(result != GLOB_NOMATCH && !(result == 0 && paths.empty()))
      << "no file matches the data pattern '" << spec << "'.";
  DSTRAIN_USER_CHECK(result == 0) << "could not expand the data pattern '" << spec << "' ("
                                  << (result == GLOB_NOSPACE ? "out of memory" : "read error")
                                  << ").";
  std::sort(paths.begin(), paths.end());  // byte order, whatever the locale
  return paths;
}

}  // namespace dstrain
