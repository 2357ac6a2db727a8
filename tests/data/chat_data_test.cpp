// Chat JSONL: both styles, every error a line can have, and the streaming reader's line numbers.
#include "data/chat_data.h"

#include <gtest/gtest.h>

#include "test_util.h"

namespace dstrain {
namespace {

using testing::TempDir;

std::vector<ChatMessage> parsed(std::string_view line) {
  std::optional<std::vector<ChatMessage>> messages = parse_chat_line(line, "t.jsonl:1");
  EXPECT_TRUE(messages.has_value()) << line;
  return messages.value_or(std::vector<ChatMessage>{});
}

TEST(ChatData, ReadsOpenAiStyle) {
  const std::vector<ChatMessage> m = parsed(
      R"({"messages": [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "Hi 🙂", "name": "ann"},
                       {"role": "assistant", "content": ""}], "id": 7})");
  ASSERT_EQ(m.size(), 3u);
  EXPECT_EQ(m[0].role, ChatRole::kSystem);
  EXPECT_EQ(m[0].content, "Be brief.");
  EXPECT_EQ(m[1].role, ChatRole::kUser);
  EXPECT_EQ(m[1].content, "Hi 🙂");
  EXPECT_EQ(m[2].role, ChatRole::kAssistant);
  EXPECT_EQ(m[2].content, "");
}

TEST(ChatData, ReadsShareGptStyleWithEitherRoleNames) {
  const std::vector<ChatMessage> m = parsed(
      R"({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "H"},
                            {"from": "gpt", "value": "G"}, {"from": "user", "value": "U"},
                            {"from": "assistant", "value": "A"}]})");
  ASSERT_EQ(m.size(), 5u);
  const ChatRole roles[] = {ChatRole::kSystem, ChatRole::kUser, ChatRole::kAssistant,
                            ChatRole::kUser, ChatRole::kAssistant};
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(m[i].role, roles[i]) << i;
  EXPECT_EQ(m[2].content, "G");
}

TEST(ChatData, JoinsTextParts) {
  const std::vector<ChatMessage> m = parsed(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a "},
                                                    {"type": "text", "text": "b"}]}]})");
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0].content, "a b");
}

TEST(ChatData, SkipsBlankLinesAndAcceptsEmptyConversations) {
  EXPECT_FALSE(parse_chat_line("", "x").has_value());
  EXPECT_FALSE(parse_chat_line("  \t\r", "x").has_value());
  EXPECT_TRUE(parsed(R"({"messages": []})").empty());
}

TEST(ChatData, EveryErrorNamesTheLineAndWhatIsWrong) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"messages\": [", "t.jsonl:1 is not valid JSON"},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\"}]}",
       "t.jsonl:1 is not valid JSON"},
      {"[1, 2]", "t.jsonl:1 is a JSON array, not an object"},
      {R"({"text": "hello"})",
       "t.jsonl:1 has neither \"messages\" (OpenAI style) nor \"conversations\""},
      {R"({"messages": {"role": "user"}})", "t.jsonl:1: \"messages\" is object, not a list."},
      {R"({"conversations": "hi"})", "t.jsonl:1: \"conversations\" is string, not a list."},
      {R"({"messages": ["hi"]})", "t.jsonl:1: message 1 is not a JSON object."},
      {R"({"messages": [{"content": "x"}]})", "t.jsonl:1: message 1 has no \"role\"."},
      {R"({"conversations": [{"value": "x"}]})", "t.jsonl:1: message 1 has no \"from\"."},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}]})",
       "t.jsonl:1: message 2 has the role \"tool\"; the accepted ones are system, user and "
       "assistant."},
      {R"({"messages": [{"role": "gpt", "content": "x"}]})", "has the role \"gpt\""},
      {R"({"conversations": [{"from": "function_call", "value": "x"}]})",
       "message 1 has the from \"function_call\"; the accepted ones are system, human, gpt, user "
       "and assistant."},
      {R"({"messages": [{"role": 3, "content": "x"}]})", "message 1 has the role 3;"},
      {R"({"messages": [{"role": "user"}]})", "t.jsonl:1: message 1 has no \"content\"."},
      {R"({"conversations": [{"from": "human"}]})", "t.jsonl:1: message 1 has no \"value\"."},
      {R"({"messages": [{"role": "user", "content": 5}]})",
       "t.jsonl:1: message 1's \"content\" is number, not a string or a list of"},
      {R"({"messages": [{"role": "assistant", "content": null, "tool_calls": []}]})",
       "message 1's \"content\" is null, not a string"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]})",
       "message 1's \"content\" has a part that is not {\"type\": \"text\", \"text\": \"...\"}"},
  };
  for (const auto& [line, sentence] : bad) {
    SCOPED_TRACE(line);
    EXPECT_USER_ERROR(parse_chat_line(line, "t.jsonl:1"), sentence);
  }
}

TEST(ChatData, ReaderStreamsConversationsWithTheirLineNumbers) {
  TempDir dir;
  const std::string path = dir.file("chat.jsonl");
  testing::write_bytes(path,
                       "{\"messages\": [{\"role\": \"user\", \"content\": \"one\"}]}\n"
                       "\n"
                       "   \r\n"
                       "{\"conversations\": [{\"from\": \"gpt\", \"value\": \"two\"}]}\r\n"
                       "{\"messages\": [{\"role\": \"assistant\", \"content\": \"three\"}]}");
  ChatJsonlReader reader(path);
  std::optional<ChatRecord> first = reader.next();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->line, 1u);
  EXPECT_EQ(first->messages.at(0).content, "one");
  std::optional<ChatRecord> second = reader.next();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->line, 4u);
  EXPECT_EQ(second->messages.at(0).content, "two") << "the \\r of a CRLF line is not content";
  std::optional<ChatRecord> third = reader.next();
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->line, 5u) << "a last line without a newline";
  EXPECT_EQ(third->messages.at(0).role, ChatRole::kAssistant);
  EXPECT_FALSE(reader.next().has_value());
  EXPECT_FALSE(reader.next().has_value());
}

TEST(ChatData, ReaderErrorsNameTheFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("bad.jsonl");
  testing::write_bytes(path, "{\"messages\": []}\n\n{\"messages\": [{\"role\": \"bot\"}]}\n");
  ChatJsonlReader reader(path);
  ASSERT_TRUE(reader.next().has_value());
  EXPECT_USER_ERROR(reader.next(), path + ":3: message 1 has the role \"bot\"");
  EXPECT_USER_ERROR(ChatJsonlReader(dir.file("missing.jsonl")),
                    "cannot open " + dir.file("missing.jsonl"));
  EXPECT_USER_ERROR(ChatJsonlReader(dir.path().string()), "is a directory");
}

}  // namespace
}  // namespace dstrain
