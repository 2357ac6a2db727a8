// prepare --chat: JSONL conversations -> token shards with loss masks (data/loss_mask.h), rendered
// with the model's chat template (data/chat_template.h) and tokenized with its tokenizer.json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "data/bpe_tokenizer.h"
#include "data/chat_template.h"
#include "data/prepare.h"

namespace dstrain {

struct ChatPrepareOptions {
  std::vector<std::string> inputs;  // JSONL files (data/chat_data.h), read one after the other
  std::string out_dir;
  // A Hugging Face model or tokenizer directory holding tokenizer.json and tokenizer_config.json
  // (the chat template, bos and eos), or the path of such a tokenizer.json.
  std::string tokenizer;
  std::string chat_template;     // --chat-template NAME|FILE; empty: tokenizer_config.json's
  double val_fraction = 0.1;     // of the conversations (the last ones); 0: none
  bool train_on_prompt = false;  // every token trained, not only the assistant's
  size_t max_shard_tokens = kDefaultMaxShardTokens;
};

struct ChatPrepareResult {
  std::string template_name;
  int64_t train_conversations = 0, val_conversations = 0;
  int64_t left_out = 0;        // conversations with nothing to train (no assistant reply)
  std::string first_left_out;  // where the first one is ("file.jsonl:12")
  size_t train_tokens = 0, val_tokens = 0;
  size_t trained_tokens = 0;                        // over both splits
  std::vector<std::string> train_files, val_files;  // the .bin shards; each has its .mask
  int64_t vocab_size = 0;
  bool uint32_tokens = false;
};

// One conversation as a shard holds it: its ids and a flag byte per id.
struct TokenizedConversation {
  std::vector<int32_t> ids;
  std::vector<uint8_t> flags;  // kMaskTrained, kMaskConversationStart (on the first)
};

// Tokenizes the rendered conversation whole (so the ids are apply_chat_template's) and flags
// as trained every token whose bytes (BpeTokenizer::encode's spans, the library's offsets)
// overlap a trained segment's bytes (a token such as " Hello" after "Assistant:", or
// SentencePiece's "▁Hello" after "[/INST]", holds an untrained space and trained text:
// trained), or every token with train_on_prompt.
TokenizedConversation tokenize_conversation(BpeTokenizer& tokenizer,
                                            std::span<const ChatSegment> segments,
                                            bool train_on_prompt);

// Reads, renders and tokenizes every conversation, leaves out (and counts) those with nothing
// trained, and writes out_dir/train_NNNNNN.bin + .mask (and val_ for the last val_fraction of
// the conversations), shards cut between conversations, at most max_shard_tokens tokens each
// unless one conversation is longer; then out_dir/prepare.json (what --show reads: the
// tokenizer and the template). Atomic as prepare(): staged, moved into place, stale shards
// removed. Throws UserError on a bad input line, an unknown template, a tokenizer that cannot
// be read, no conversation left to train, or a split that leaves no training conversation.
ChatPrepareResult prepare_chat(const ChatPrepareOptions& options);

// Conversation `index` (from 0, in shard order) of out_dir's training shards as text, its
// trained spans between "[TRAINED]" and "[/TRAINED]", after a line saying where it is and how
// many of its tokens are trained. `tokenizer`: as in ChatPrepareOptions; empty: the one
// out_dir/prepare.json names. Throws UserError when out_dir has no chat shards, the index is
// out of range, or there is no tokenizer to decode with.
std::string show_conversation(const std::string& out_dir, int64_t index,
                              const std::string& tokenizer);

}  // namespace dstrain
