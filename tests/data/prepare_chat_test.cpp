// prepare --chat: conversations rendered with the model's template, tokenized whole, the
// assistant's tokens flagged trained, written as shards with loss masks beside them.
//  - For every family and case of tests/reference/chat/: the ids are transformers'
//    apply_chat_template ids and the trained flags are the fixture's trained_tokens (each
//    token's bytes from the `tokenizers` vocabulary, overlapping a trained span).
//  - End to end: the shards read back as the conversations, in file order; the ones with nothing
//    to train are left out and counted; the last ones are the validation split; --show marks
//    the trained text; a bad line writes nothing.
#include "data/prepare_chat.h"

#include <gtest/gtest.h>

#include <fstream>

#include "chat_fixtures.h"
#include "data/loader.h"
#include "data/loss_mask.h"
#include "data/prepare.h"
#include "test_util.h"

namespace dstrain {
namespace {

using namespace chat_fixtures;
using testing::TempDir;

TEST(PrepareChat, IdsAndTrainedTokensAreTransformersAndTheFixtures) {
  size_t checked = 0, trained = 0;
  for (const json& result : fixtures()["results"]) {
    if (!result.contains("ids")) continue;
    const std::string family = result["family"], name = result["case"];
    SCOPED_TRACE(family + " / " + name);
    const ChatTemplate chat_template = load_chat_template(kChat + family, "");
    const std::vector<ChatSegment> segments = render_chat(chat_template, case_messages(name), name);
    const TokenizedConversation c =
        tokenize_conversation(family_tokenizer(family), segments, false);
    EXPECT_EQ(c.ids, result["ids"].get<std::vector<int32_t>>());
    std::vector<int> got;
    for (uint8_t f : c.flags) got.push_back((f & kMaskTrained) != 0);
    if (!got.empty()) got[0] = 0;  // the first token is never a target
    EXPECT_EQ(got, result["trained_tokens"].get<std::vector<int>>());
    ASSERT_FALSE(c.flags.empty());
    EXPECT_TRUE(c.flags[0] & kMaskConversationStart);
    for (size_t i = 1; i < c.flags.size(); ++i) EXPECT_FALSE(c.flags[i] & kMaskConversationStart);
    const TokenizedConversation all =
        tokenize_conversation(family_tokenizer(family), segments, true);
    EXPECT_EQ(all.ids, c.ids);
    for (uint8_t f : all.flags) EXPECT_TRUE(f & kMaskTrained) << "--train-on-prompt";
    ++checked;
    for (int t : got) trained += t;
  }
  EXPECT_GT(checked, 140u);
  EXPECT_GT(trained, 1000u);
}

// The fixture's conversations of `family` as OpenAI-style JSONL, each case `copies` times.
std::vector<std::string> write_jsonl(const std::string& path, const std::string& family) {
  std::ofstream out(path);
  std::vector<std::string> written;  // the case names, in file order
  for (const json& result : fixtures()["results"]) {
    if (result["family"] != family || !result.contains("ids")) continue;
    for (const json& c : fixtures()["cases"]) {
      if (c["name"] != result["case"]) continue;
      out << json{{"messages", c["messages"]}}.dump() << "\n";
      written.push_back(c["name"]);
    }
  }
  return written;
}

const json& result_of(const std::string& family, const std::string& name) {
  for (const json& result : fixtures()["results"]) {
    if (result["family"] == family && result["case"] == name) return result;
  }
  throw std::runtime_error("no fixture " + family + "/" + name);
}

TEST(PrepareChat, ShardsHoldTheConversationsInFileOrderWithTheirMasks) {
  TempDir dir;
  const std::string family = "qwen2.5";
  const std::vector<std::string> names = write_jsonl(dir.file("chat.jsonl"), family);
  ChatPrepareOptions options;
  options.inputs = {dir.file("chat.jsonl")};
  options.out_dir = dir.file("out");
  options.tokenizer = kChat + family;  // a directory
  options.val_fraction = 0.25;
  options.max_shard_tokens = 200;  // several shards, cut between conversations
  const ChatPrepareResult prepared = prepare_chat(options);
  EXPECT_EQ(prepared.template_name, "qwen2.5");
  // Kept: the conversations with a trained token (an assistant reply).
  std::vector<std::string> kept;
  for (const std::string& name : names) {
    const json& r = result_of(family, name);
    const std::vector<int> flags = r["trained_tokens"];
    if (std::count(flags.begin(), flags.end(), 1) > 0) kept.push_back(name);
  }
  ASSERT_LT(kept.size(), names.size()) << "the fixture must have a conversation without a reply";
  EXPECT_EQ(prepared.left_out, static_cast<int64_t>(names.size() - kept.size()));
  EXPECT_EQ(prepared.train_conversations + prepared.val_conversations,
            static_cast<int64_t>(kept.size()));
  EXPECT_EQ(prepared.val_conversations, std::llround(0.25 * static_cast<double>(kept.size())));
  EXPECT_GT(prepared.train_files.size(), 1u);

  // Read back, train then val, every conversation in order: its ids and trained flags.
  size_t next = 0;
  for (const char* split : {"train", "val"}) {
    const TokenDataset data = TokenDataset::open(options.out_dir + "/" + split + "_*.bin", 1 << 16);
    ASSERT_TRUE(data.masked());
    const ConversationIndex index = index_conversations(data, 1 << 20);
    EXPECT_EQ(index.fragments, 0);
    for (const Conversation& c : index.conversations) {
      ASSERT_LT(next, kept.size());
      const json& r = result_of(family, kept[next++]);
      const TokenRange& range = data.shards()[c.shard];
      std::vector<int32_t> ids(c.length);
      range.source->read(range.begin + c.offset, ids.size(), ids.data());
      EXPECT_EQ(ids, r["ids"].get<std::vector<int32_t>>()) << kept[next - 1];
      std::vector<int> flags;
      for (size_t i = 0; i < ids.size(); ++i) {
        flags.push_back(i > 0 && (range.source->mask()[range.begin + c.offset + i] & kMaskTrained));
      }
      EXPECT_EQ(flags, r["trained_tokens"].get<std::vector<int>>()) << kept[next - 1];
    }
  }
  EXPECT_EQ(next, kept.size());

  const std::string shown = show_conversation(options.out_dir, 0, "");
  const json& first = result_of(family, kept[0]);
  EXPECT_NE(shown.find("conversation 0 ("), std::string::npos) << shown;
  // The trained spans, marked, are the fixture's: strip the markers and compare the text, then
  // check that the first marked span is the first trained byte span.
  std::string text = shown.substr(shown.find('\n') + 1);
  text.pop_back();  // the final newline
  const size_t open = text.find("[TRAINED]");
  ASSERT_NE(open, std::string::npos) << shown;
  EXPECT_EQ(open, first["trained"][0][0].get<size_t>()) << shown;
  std::string plain;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, 9, "[TRAINED]") == 0)
      i += 9;
    else if (text.compare(i, 10, "[/TRAINED]") == 0)
      i += 10;
    else
      plain += text[i++];
  }
  EXPECT_EQ(plain, first["text"].get<std::string>());
  EXPECT_USER_ERROR(show_conversation(options.out_dir, 1000, ""), "there is no conversation 1000");
}

TEST(PrepareChat, ABadLineWritesNothingAndNamesTheLine) {
  TempDir dir;
  {
    std::ofstream out(dir.file("chat.jsonl"));
    out << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
        << "\n\n"
        << R"({"messages": [{"role": "robot", "content": "hi"}]})"
        << "\n";
  }
  ChatPrepareOptions options;
  options.inputs = {dir.file("chat.jsonl")};
  options.out_dir = dir.file("out");
  options.tokenizer = kChat + "llama3.1/tokenizer.json";  // the file: its directory's config
  EXPECT_USER_ERROR(prepare_chat(options), "chat.jsonl:3");
  EXPECT_TRUE(std::filesystem::is_empty(options.out_dir));
}

TEST(PrepareChat, NothingToTrainAndUnknownTemplatesAreOneSentence) {
  TempDir dir;
  {
    std::ofstream out(dir.file("chat.jsonl"));
    out << R"({"conversations": [{"from": "human", "value": "hi"}]})"
        << "\n";
  }
  ChatPrepareOptions options;
  options.inputs = {dir.file("chat.jsonl")};
  options.out_dir = dir.file("out");
  options.tokenizer = kChat + "qwen2";
  EXPECT_USER_ERROR(prepare_chat(options), "no conversation in the input has anything to train");
  options.train_on_prompt = true;  // then the prompt is trained
  options.val_fraction = 0;
  EXPECT_EQ(prepare_chat(options).train_conversations, 1);
  options.chat_template = "vicuna";
  EXPECT_USER_ERROR(prepare_chat(options), "llama3");
}

TEST(PrepareChat, TextPreparedOverChatShardsRemovesTheirMasks) {
  TempDir dir;
  {
    std::ofstream out(dir.file("chat.jsonl"));
    for (int i = 0; i < 8; ++i) {
      out << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
          << "\n";
    }
  }
  ChatPrepareOptions options;
  options.inputs = {dir.file("chat.jsonl")};
  options.out_dir = dir.file("out");
  options.tokenizer = kChat + "qwen2";
  prepare_chat(options);
  ASSERT_TRUE(std::filesystem::exists(dir.file("out/train_000000.mask")));
  {
    std::ofstream text(dir.file("text.txt"));
    for (int i = 0; i < 200; ++i) text << "some plain text line " << i << "\n";
  }
  prepare(dir.file("text.txt"), options.out_dir);
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/train_000000.mask")));
  EXPECT_FALSE(TokenDataset::open(options.out_dir + "/train_*.bin", 256).masked());
}

}  // namespace
}  // namespace dstrain
