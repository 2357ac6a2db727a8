// Native chat templates against transformers: tests/reference/chat/ (made by
// tests/reference/make_chat_fixtures.py) holds the real chat_template texts of Llama 3/3.1/3.2,
// Qwen2/2.5, DeepSeek and Mistral/Mixtral, small tokenizers of their kinds, and for every
// family and conversation transformers 4.41's rendering, ids and trained byte spans, or the
// error its template raised.
#include "data/chat_template.h"

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include "chat_fixtures.h"
#include "core/fs.h"
#include "data/bpe_tokenizer.h"
#include "test_util.h"

namespace dstrain {
namespace {

using nlohmann::json;
using testing::TempDir;
using namespace chat_fixtures;

// [begin, end) byte offsets of the trained segments.
std::vector<std::vector<size_t>> trained_spans(const std::vector<ChatSegment>& segments) {
  std::vector<std::vector<size_t>> spans;
  size_t offset = 0;
  for (const ChatSegment& segment : segments) {
    if (segment.trained) spans.push_back({offset, offset + segment.text.size()});
    offset += segment.text.size();
  }
  return spans;
}

TEST(ChatTemplate, EveryFamilyDirectoryIsRecognisedAsItsTemplate) {
  ASSERT_EQ(fixtures()["families"].size(), 11u);
  for (const auto& [family, info] : fixtures()["families"].items()) {
    const ChatTemplate loaded = load_chat_template(kChat + family, "");
    EXPECT_EQ(chat_template_name(loaded.kind), info["template"].get<std::string>()) << family;
  }
}

TEST(ChatTemplate, RendersEveryCaseAsTransformersDoes) {
  size_t rendered = 0, refused = 0, trained = 0;
  for (const json& result : fixtures()["results"]) {
    const std::string family = result["family"], name = result["case"];
    const ChatTemplate chat_template = load_chat_template(kChat + family, "");
    const std::vector<ChatMessage>& messages = case_messages(name);
    const std::string where = family + "/" + name;
    if (result.contains("error")) {
      EXPECT_USER_ERROR(render_chat(chat_template, messages, where), where + ": message ");
      ++refused;
      continue;
    }
    const std::vector<ChatSegment> segments = render_chat(chat_template, messages, where);
    EXPECT_EQ(chat_text(segments), result["text"].get<std::string>()) << where;
    EXPECT_EQ(trained_spans(segments), result["trained"].get<std::vector<std::vector<size_t>>>())
        << where;
    EXPECT_EQ(chat_text(render_chat(chat_template, messages, where, true)),
              result["prompt_text"].get<std::string>())
        << where << " with the generation prompt";
    ++rendered;
    trained += result["trained"].size();
  }
  EXPECT_EQ(rendered + refused, 165u);
  EXPECT_GE(refused, 15u);
  EXPECT_GE(trained, 150u) << "the fixtures must train something";
}

TEST(ChatTemplate, FamilyTokenizersGiveTransformersIds) {
  size_t checked = 0;
  for (const json& result : fixtures()["results"]) {
    if (result.contains("error")) continue;
    const std::string family = result["family"];
    const std::vector<int32_t> expected = result["ids"].get<std::vector<int32_t>>();
    ASSERT_FALSE(expected.empty());
    EXPECT_EQ(family_tokenizer(family).encode(result["text"].get<std::string>()), expected)
        << family << "/" << result["case"].get<std::string>();
    ++checked;
  }
  EXPECT_GE(checked, 140u);
}

TEST(ChatTemplate, RecognisesTheRealTemplatesAndTheirRevisions) {
  const std::map<std::string, std::string> expected = {{"llama3.jinja", "llama3"},
                                                       {"llama3.1.jinja", "llama3.1"},
                                                       {"llama3.2.jinja", "llama3.1"},
                                                       {"qwen2.jinja", "qwen2"},
                                                       {"qwen2.5.jinja", "qwen2.5"},
                                                       {"qwen2.5-0.5b.jinja", "qwen2.5"},
                                                       {"deepseek-llm.jinja", "deepseek-llm"},
                                                       {"deepseek-v3.jinja", "deepseek-v3"},
                                                       {"deepseek-r1.jinja", "deepseek-r1"},
                                                       {"mixtral.jinja", "mistral-v1"},
                                                       {"mixtral-legacy.jinja", "mistral-legacy"},
                                                       {"mistral-v0.3.jinja", "mistral-v3"}};
  for (const auto& [file, name] : expected)
    EXPECT_EQ(chat_template_name(recognize_chat_template(template_text(file), file)), name) << file;
}

TEST(ChatTemplate, RefusesRevisionsThatRenderDifferently) {
  // R1-0528 puts <｜Assistant｜> after every user turn; Mixtral-8x22B's v3 does not trim; the
  // first v0.3 template drops system messages and spaces [INST] differently.
  for (const char* file :
       {"deepseek-r1-0528.jinja", "mixtral-8x22b.jinja", "mistral-v0.3-2024-05.jinja"}) {
    SCOPED_TRACE(file);
    EXPECT_USER_ERROR(recognize_chat_template(template_text(file), file), file,
                      "does not recognise", "--chat-template", "llama3.1, qwen2");
  }
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
    text.replace(at, from.size(), to);
  return text;
}

TEST(ChatTemplate, RecognisesFormattingThatDoesNotChangeTheOutput) {
  // Whitespace control, spaces, newlines between tags, "\n" escapes, double quotes and
  // attribute access instead of subscripts.
  std::string text = replaced(template_text("qwen2.jinja"), "\n", "\\n");
  text = replaced(text, "{%", "{%- ");
  text = replaced(text, "%}", " -%}\n  ");
  text = replaced(text, "{{", "{{ ");
  text = replaced(text, "message['role']", "message.role");
  text = replaced(text, "'", "\"");
  EXPECT_EQ(recognize_chat_template(text, "reformatted"), ChatTemplateKind::kQwen2) << text;
  const std::string with_comment = "{# ChatML #}\n" + template_text("deepseek-llm.jinja");
  EXPECT_EQ(recognize_chat_template(with_comment, "commented"), ChatTemplateKind::kDeepSeekLlm);
}

TEST(ChatTemplate, RefusesModifiedTemplatesInOneSentence) {
  const std::vector<std::pair<std::string, std::string>> modified = {
      {replaced(template_text("qwen2.jinja"), "You are a helpful assistant.", "Be a pirate."),
       "a changed default system prompt"},
      {replaced(template_text("llama3.1.jinja"), "message['content'] | trim", "message['content']"),
       "no trim"},
      {replaced(template_text("mixtral.jinja"), "' [INST] '", "'[INST]'"), "other spacing"},
      {replaced(template_text("deepseek-llm.jinja"), "'User: '", "'Human: '"), "another role name"},
      {"{% for message in messages %}{{ message['content'] }}{% endfor %}", "an unknown template"},
      {"", "an empty text"}};
  for (const auto& [text, what] : modified) {
    SCOPED_TRACE(what);
    EXPECT_USER_ERROR(recognize_chat_template(text, "custom.jinja"),
                      "custom.jinja holds a chat template dstrain does not recognise",
                      "--chat-template NAME", "--chat-template FILE", "mistral-v3");
  }
}

TEST(ChatTemplate, OverrideByNameKeepsTheDirectorysTokens) {
  const ChatTemplate by_name = load_chat_template(kChat + "deepseek-v3", "deepseek-llm");
  EXPECT_EQ(by_name.kind, ChatTemplateKind::kDeepSeekLlm);
  EXPECT_EQ(by_name.bos_token, "<｜begin▁of▁sentence｜>") << "an {\"content\"} object";
  EXPECT_EQ(by_name.eos_token, "<｜end▁of▁sentence｜>");
  const ChatTemplate without_dir = load_chat_template("", "llama3.1");
  EXPECT_EQ(without_dir.bos_token, "<|begin_of_text|>") << "the family's default";
  EXPECT_EQ(chat_template_kind("mistral-v3"), ChatTemplateKind::kMistralV3);
  EXPECT_USER_ERROR(chat_template_kind("llama4"), "\"llama4\" is not a known chat template",
                    "deepseek-r1");
}

TEST(ChatTemplate, OverrideByFileIsRecognised) {
  const ChatTemplate by_file =
      load_chat_template(kChat + "qwen2", kChat + "templates/mixtral.jinja");
  EXPECT_EQ(by_file.kind, ChatTemplateKind::kMistralV1);
  EXPECT_EQ(by_file.eos_token, "<|im_end|>") << "the directory's eos";
  EXPECT_EQ(by_file.bos_token, "<s>") << "Qwen's bos is null: the family's default";
  EXPECT_USER_ERROR(load_chat_template(kChat + "qwen2", "/no/such/template.jinja"),
                    "--chat-template /no/such/template.jinja is neither a known template",
                    "llama3, llama3.1");
  TempDir dir;
  testing::write_bytes(dir.file("odd.jinja"), "{{ messages }}");
  EXPECT_USER_ERROR(load_chat_template(kChat + "qwen2", dir.file("odd.jinja")),
                    dir.file("odd.jinja") + " holds a chat template dstrain does not recognise");
}

TEST(ChatTemplate, TokenizerConfigErrorsAreOneSentence) {
  TempDir dir;
  EXPECT_USER_ERROR(load_chat_template(dir.path().string(), ""),
                    dir.file("tokenizer_config.json") + " does not exist", "--chat-template");
  testing::write_bytes(dir.file("tokenizer_config.json"), "{not json");
  EXPECT_USER_ERROR(load_chat_template(dir.path().string(), ""), "is not a JSON object");
  testing::write_bytes(dir.file("tokenizer_config.json"), R"({"eos_token": "</s>"})");
  EXPECT_USER_ERROR(load_chat_template(dir.path().string(), ""), "has no chat_template",
                    "--chat-template NAME|FILE");
  EXPECT_EQ(load_chat_template(dir.path().string(), "mistral-v1").eos_token, "</s>");
  testing::write_bytes(dir.file("tokenizer_config.json"), R"({"chat_template": 7})");
  EXPECT_USER_ERROR(load_chat_template(dir.path().string(), ""), "is neither a string nor a list");
  testing::write_bytes(dir.file("tokenizer_config.json"),
                       R"({"chat_template": [{"name": "tool_use", "template": "x"}]})");
  EXPECT_USER_ERROR(load_chat_template(dir.path().string(), ""), "no \"default\" template");
}

TEST(ChatTemplate, ReadsTheDefaultOfATemplateList) {
  TempDir dir;
  const json config = {
      {"bos_token", {{"content", "<B>"}}},
      {"eos_token", "<E>"},
      {"chat_template",
       json::array({{{"name", "tool_use"}, {"template", "x"}},
                    {{"name", "default"}, {"template", template_text("deepseek-llm.jinja")}}})}};
  testing::write_bytes(dir.file("tokenizer_config.json"), config.dump());
  const ChatTemplate loaded = load_chat_template(dir.path().string(), "");
  EXPECT_EQ(loaded.kind, ChatTemplateKind::kDeepSeekLlm);
  EXPECT_EQ(loaded.bos_token, "<B>");
  const std::vector<ChatMessage> chat = {{ChatRole::kUser, "Hi"}, {ChatRole::kAssistant, "Yo"}};
  EXPECT_EQ(chat_text(render_chat(loaded, chat, "x")), "<B>User: Hi\n\nAssistant: Yo<E>");
}

TEST(ChatTemplate, SegmentsAlternateAndEmptyConversationsRenderNothing) {
  for (const std::string& name : chat_template_names()) {
    const ChatTemplate t = default_chat_template(chat_template_kind(name));
    EXPECT_TRUE(render_chat(t, {}, "empty").empty()) << name;
    // Without its system message, which mistral-legacy refuses.
    const std::span<const ChatMessage> turns = std::span(case_messages("three_turns")).subspan(1);
    const std::vector<ChatSegment> segments = render_chat(t, turns, "three_turns");
    ASSERT_GE(segments.size(), 6u) << name;
    for (size_t i = 1; i < segments.size(); ++i)
      EXPECT_NE(segments[i].trained, segments[i - 1].trained) << name;
    for (const ChatSegment& segment : segments) EXPECT_FALSE(segment.text.empty()) << name;
  }
}

TEST(ChatTemplate, MistralRefusalsNameTheConversationAndTheMessage) {
  const ChatTemplate v1 = default_chat_template(ChatTemplateKind::kMistralV1);
  EXPECT_USER_ERROR(render_chat(v1, case_messages("consecutive_users"), "train.jsonl:7"),
                    "train.jsonl:7: message 2 is a user turn where the mistral-v1 chat template "
                    "needs an assistant turn");
  EXPECT_USER_ERROR(render_chat(v1, case_messages("system_not_first"), "train.jsonl:8"),
                    "train.jsonl:8: message 2 is a system message", "only as the first message");
  const ChatTemplate legacy = default_chat_template(ChatTemplateKind::kMistralLegacy);
  EXPECT_USER_ERROR(render_chat(legacy, case_messages("system_multi_turn"), "c3"),
                    "c3: message 1 is a system message, which the mistral-legacy chat template "
                    "does not accept.");
}

}  // namespace
}  // namespace dstrain
