#include "data/prepare_chat.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/check.h"
#include "core/fs.h"
#include "data/chat_data.h"
#include "data/loader.h"
#include "data/loss_mask.h"
#include "data/prepare_util.h"
#include "data/token_file.h"

namespace dstrain {

namespace {

namespace fs = std::filesystem;

constexpr const char* kPrepareRecord = "prepare.json";

// {tokenizer.json, the directory of its tokenizer_config.json} of a --tokenizer path.
std::pair<std::string, std::string> tokenizer_files(const std::string& path) {
  DSTRAIN_USER_CHECK(!path.empty())
      << "prepare --chat needs --tokenizer DIR (a Hugging Face model directory with "
      << "tokenizer.json and tokenizer_config.json).";
  std::error_code error;
  if (fs::is_directory(path, error)) return {(fs::path(path) / "tokenizer.json").string(), path};
  const fs::path parent = fs::path(path).parent_path();
  return {path, parent.empty() ? "." : parent.string()};
}

// The [begin, end) byte ranges of the trained segments in the text of all segments.
std::vector<std::pair<size_t, size_t>> trained_ranges(std::span<const ChatSegment> segments) {
  std::vector<std::pair<size_t, size_t>> ranges;
  size_t offset = 0;
  for (const ChatSegment& segment : segments) {
    if (segment.trained) ranges.emplace_back(offset, offset + segment.text.size());
    offset += segment.text.size();
  }
  return ranges;
}

}  // namespace

TokenizedConversation tokenize_conversation(BpeTokenizer& tokenizer,
                                            std::span<const ChatSegment> segments,
                                            bool train_on_prompt) {
  TokenizedConversation out;
  const std::string text = chat_text(segments);
  std::vector<BpeTokenizer::TokenSpan> spans;  // each token's bytes, rising
  out.ids = tokenizer.encode(text, spans);
  out.flags.assign(out.ids.size(), train_on_prompt ? kMaskTrained : 0);
  if (out.ids.empty()) return out;
  out.flags[0] |= kMaskConversationStart;
  if (train_on_prompt) return out;
  // Token t stands for bytes [spans[t].begin, spans[t].end); the ranges come in order.
  size_t token = 0;
  for (const auto& [first, last] : trained_ranges(segments)) {
    if (first == last) continue;
    while (token < out.ids.size() && spans[token].end <= first) ++token;
    for (size_t t = token; t < out.ids.size() && spans[t].begin < last; ++t) {
      out.flags[t] |= kMaskTrained;
    }
  }
  return out;
}

namespace {

// What prepare_chat collects before it writes: every kept conversation's tokens and flags
// spooled, and their lengths.
struct ChatSpool {
  Spool tokens, flags;
  std::vector<uint32_t> lengths;
  size_t trained = 0;
};

void spool_conversations(const ChatPrepareOptions& options, const ChatTemplate& chat_template,
                         BpeTokenizer& tokenizer, ChatSpool& spool, ChatPrepareResult& result) {
  for (const std::string& input : options.inputs) {
    ChatJsonlReader reader(input);
    while (std::optional<ChatRecord> record = reader.next()) {
      const std::string where = input + ":" + std::to_string(record->line);
      const std::vector<ChatSegment> segments = render_chat(chat_template, record->messages, where);
      const TokenizedConversation c =
          tokenize_conversation(tokenizer, segments, options.train_on_prompt);
      const size_t trained = static_cast<size_t>(
          std::count_if(c.flags.begin() + (c.flags.empty() ? 0 : 1), c.flags.end(),
                        [](uint8_t f) { return (f & kMaskTrained) != 0; }));
      if (trained == 0) {
        if (result.left_out++ == 0) result.first_left_out = where;
        continue;
      }
      DSTRAIN_USER_CHECK(c.ids.size() <= options.max_shard_tokens)
          << where << ": the conversation has " << c.ids.size() << " tokens, more than a shard "
          << "holds (" << options.max_shard_tokens << ").";
      spool.tokens.append(c.ids);
      spool.flags.append(std::vector<int32_t>(c.flags.begin(), c.flags.end()));
      spool.lengths.push_back(static_cast<uint32_t>(c.ids.size()));
      spool.trained += trained;
    }
  }
}

// Writes conversations [first, end) of the spool as split_NNNNNN.bin + .mask in `staging`,
// shards cut between conversations; returns the .bin names and adds the tokens to `tokens`.
std::vector<std::string> write_chat_split(ChatSpool& spool, size_t first, size_t end,
                                          const fs::path& staging, const char* split,
                                          size_t max_shard_tokens, TokenFormat format,
                                          size_t& tokens) {
  std::vector<std::string> names;
  std::vector<int32_t> ids, flags;
  for (size_t c = first; c < end;) {
    size_t shard_end = c, shard_tokens = 0;
    while (shard_end < end &&
           (shard_end == c || shard_tokens + spool.lengths[shard_end] <= max_shard_tokens)) {
      shard_tokens += spool.lengths[shard_end++];
    }
    names.push_back(shard_name(split, names.size()));
    TokenFileWriter token_writer((staging / names.back()).string(), format, shard_tokens);
    MaskFileWriter mask_writer((staging / shard_name(split, names.size() - 1, ".mask")).string(),
                               shard_tokens);
    spool.tokens.read(shard_tokens, ids);
    spool.flags.read(shard_tokens, flags);
    token_writer.append(ids);
    mask_writer.append(std::vector<uint8_t>(flags.begin(), flags.end()));
    token_writer.commit();
    mask_writer.commit();
    tokens += shard_tokens;
    c = shard_end;
  }
  return names;
}

// Moves every shard and its mask into out_dir; returns the .bin paths.
std::vector<std::string> publish(const std::vector<std::string>& names, const fs::path& staging,
                                 const std::string& out_dir) {
  std::vector<std::string> files;
  for (const std::string& name : names) {
    move_into_place(staging, out_dir, mask_path_for(name));
    files.push_back(move_into_place(staging, out_dir, name));
  }
  return files;
}

void write_prepare_record(const ChatPrepareOptions& options, const ChatPrepareResult& result,
                          const std::string& tokenizer_json) {
  const nlohmann::json record{{"kind", "chat"},
                              {"tokenizer", fs::absolute(tokenizer_json).string()},
                              {"chat_template", result.template_name},
                              {"train_on_prompt", options.train_on_prompt},
                              {"inputs", options.inputs},
                              {"train_conversations", result.train_conversations},
                              {"val_conversations", result.val_conversations},
                              {"left_out", result.left_out},
                              {"train_tokens", result.train_tokens},
                              {"val_tokens", result.val_tokens},
                              {"trained_tokens", result.trained_tokens}};
  AtomicFileWriter file(fs::path(options.out_dir) / kPrepareRecord);
  file.write(record.dump(2) + "\n");
  file.commit();
}

}  // namespace

ChatPrepareResult prepare_chat(const ChatPrepareOptions& options) {
  DSTRAIN_USER_CHECK(!options.inputs.empty()) << "prepare --chat needs a JSONL file.";
  DSTRAIN_USER_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0)
      << "the validation fraction must be at least 0 (no validation shards) and below 1, not "
      << options.val_fraction << ".";
  const auto [tokenizer_json, config_dir] = tokenizer_files(options.tokenizer);
  const ChatTemplate chat_template = load_chat_template(config_dir, options.chat_template);
  BpeTokenizer tokenizer = BpeTokenizer::from_file(tokenizer_json);
  ChatPrepareResult result;
  result.template_name = chat_template_name(chat_template.kind);
  result.vocab_size = tokenizer.vocab_size();
  result.uint32_tokens = tokenizer.vocab_size() > 65536;

  const fs::path staging = make_staging_directory(options.out_dir);
  const TreeRemover remove_staging{staging};
  ChatSpool spool{Spool(staging / "tokens.spool", result.uint32_tokens ? 4 : 2),
                  Spool(staging / "flags.spool", 1),
                  {},
                  0};
  spool_conversations(options, chat_template, tokenizer, spool, result);
  const size_t n = spool.lengths.size();
  DSTRAIN_USER_CHECK(n > 0) << "no conversation in the input has anything to train (an "
                            << "assistant reply); " << result.left_out << " were read.";
  const size_t val = options.val_fraction == 0.0
                         ? 0
                         : std::max<size_t>(1, static_cast<size_t>(std::llround(
                                                   options.val_fraction * static_cast<double>(n))));
  DSTRAIN_USER_CHECK(val < n) << "a validation fraction of " << options.val_fraction
                              << " leaves none of the " << n << " conversations for training; "
                              << "use a smaller fraction (or 0) or more conversations.";
  result.train_conversations = static_cast<int64_t>(n - val);
  result.val_conversations = static_cast<int64_t>(val);
  result.trained_tokens = spool.trained;
  const TokenFormat format = result.uint32_tokens ? TokenFormat::kLlmcU32 : TokenFormat::kLlmcU16;
  spool.tokens.rewind();
  spool.flags.rewind();
  const std::vector<std::string> train = write_chat_split(
      spool, 0, n - val, staging, "train", options.max_shard_tokens, format, result.train_tokens);
  const std::vector<std::string> val_names = write_chat_split(
      spool, n - val, n, staging, "val", options.max_shard_tokens, format, result.val_tokens);
  result.train_files = publish(train, staging, options.out_dir);
  result.val_files = publish(val_names, staging, options.out_dir);
  fsync_directory(options.out_dir);
  remove_stale_shards(options.out_dir, "train", train.size(), true);
  remove_stale_shards(options.out_dir, "val", val_names.size(), true);
  write_prepare_record(options, result, tokenizer_json);
  return result;
}

// ---------------------------------------------------------------------------------------------
// --show

namespace {

std::string recorded_tokenizer(const std::string& out_dir) {
  const fs::path path = fs::path(out_dir) / kPrepareRecord;
  std::ifstream in(path);
  DSTRAIN_USER_CHECK(in.good()) << "'" << out_dir << "' has no " << kPrepareRecord
                                << " (written by prepare --chat); give --tokenizer DIR.";
  const nlohmann::json record = nlohmann::json::parse(in, nullptr, false);
  DSTRAIN_USER_CHECK(record.is_object() && record.contains("tokenizer") &&
                     record["tokenizer"].is_string())
      << "'" << path.string() << "' names no tokenizer; give --tokenizer DIR.";
  return record["tokenizer"].get<std::string>();
}

// Where conversation `index` lies: {shard, first token, end token}.
struct Located {
  size_t shard = 0, begin = 0, end = 0;
};

Located locate(const TokenDataset& data, int64_t index) {
  int64_t seen = 0;
  for (size_t s = 0; s < data.shards().size(); ++s) {
    const std::span<const uint8_t> mask = data.shards()[s].source->mask();
    for (size_t t = 0; t < mask.size(); ++t) {
      if ((mask[t] & kMaskConversationStart) == 0 || seen++ != index) continue;
      size_t end = t + 1;
      while (end < mask.size() && (mask[end] & kMaskConversationStart) == 0) ++end;
      return {s, t, end};
    }
  }
  DSTRAIN_USER_ERROR() << "there is no conversation " << index << ": the training shards hold "
                       << seen << " (numbered from 0).";
  return {};
}

}  // namespace

std::string show_conversation(const std::string& out_dir, int64_t index,
                              const std::string& tokenizer) {
  DSTRAIN_USER_CHECK(index >= 0) << "--show takes a conversation number from 0, not " << index;
  const std::string json =
      tokenizer.empty() ? recorded_tokenizer(out_dir) : tokenizer_files(tokenizer).first;
  BpeTokenizer bpe = BpeTokenizer::from_file(json);
  const TokenDataset data =
      TokenDataset::open((fs::path(out_dir) / "train_*.bin").string(), bpe.vocab_size());
  DSTRAIN_USER_CHECK(data.masked()) << "'" << out_dir << "' holds text shards, not chat data "
                                    << "(no loss masks beside them).";
  const Located at = locate(data, index);
  const TokenSource& source = *data.shards()[at.shard].source;
  std::vector<int32_t> ids(at.end - at.begin);
  source.read(at.begin, ids.size(), ids.data());
  const std::span<const uint8_t> flags = source.mask().subspan(at.begin, ids.size());
  std::ostringstream text;
  size_t trained = 0;
  for (size_t i = 1; i < ids.size(); ++i) trained += (flags[i] & kMaskTrained) != 0;
  text << "conversation " << index << " (" << source.name() << ", tokens " << at.begin << ".."
       << at.end - 1 << "): " << ids.size() << " tokens, " << trained << " trained\n";
  for (size_t i = 0; i < ids.size();) {
    size_t j = i;
    const bool on = (flags[i] & kMaskTrained) != 0 && i > 0;
    while (j < ids.size() && ((flags[j] & kMaskTrained) != 0 && j > 0) == on) ++j;
    const std::string bytes = bpe.decode_bytes(std::span<const int32_t>(ids.data() + i, j - i));
    text << (on ? "[TRAINED]" : "") << bytes << (on ? "[/TRAINED]" : "");
    i = j;
  }
  text << "\n";
  return text.str();
}

}  // namespace dstrain
