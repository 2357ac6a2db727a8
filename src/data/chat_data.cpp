#include "data/chat_data.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/check.h"

namespace dstrain {

namespace {

using nlohmann::json;

// The two JSONL styles: where the list is and what its messages' keys are called.
struct ChatStyle {
  const char* list_key;
  const char* role_key;
  const char* content_key;
  const char* accepted_roles;  // for the error sentence
  bool sharegpt;               // also "human" and "gpt"
};

constexpr ChatStyle kOpenAi{"messages", "role", "content", "system, user and assistant", false};
constexpr ChatStyle kShareGpt{"conversations", "from", "value",
                              "system, human, gpt, user and assistant", true};

std::optional<ChatRole> role_of(const std::string& role, const ChatStyle& style) {
  if (role == "system") return ChatRole::kSystem;
  if (role == "user") return ChatRole::kUser;
  if (role == "assistant") return ChatRole::kAssistant;
  if (style.sharegpt && role == "human") return ChatRole::kUser;
  if (style.sharegpt && role == "gpt") return ChatRole::kAssistant;
  return std::nullopt;
}

// "message 3's \"content\"" for error sentences.
std::string field_name(size_t index, const char* key) {
  return "message " + std::to_string(index + 1) + "'s \"" + key + "\"";
}

// A content: a string, or a list of {"type": "text", "text": ...} parts joined.
std::string content_text(const json& content, size_t index, const ChatStyle& style,
                         const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  DSTRAIN_USER_CHECK(content.is_array())
      << where << ": " << field_name(index, style.content_key) << " is " << content.type_name()
      << ", not a string or a list of {\"type\": \"text\", \"text\": ...} parts.";
  std::string text;
  for (const json& part : content) {
    const bool is_text = part.is_object() && part.value("type", json()) == "text" &&
                         part.contains("text") && part["text"].is_string();
    DSTRAIN_USER_CHECK(is_text)
        << where << ": " << field_name(index, style.content_key) << " has a part that is not "
        << "{\"type\": \"text\", \"text\": \"...\"}; only text can be trained on.";
    text += part["text"].get<std::string>();
  }
  return text;
}

ChatMessage parse_message(const json& message, size_t index, const ChatStyle& style,
                          const std::string& where) {
  const std::string name = "message " + std::to_string(index + 1);
  DSTRAIN_USER_CHECK(message.is_object()) << where << ": " << name << " is not a JSON object.";
  const auto role = message.find(style.role_key);
  DSTRAIN_USER_CHECK(role != message.end())
      << where << ": " << name << " has no \"" << style.role_key << "\".";
  const std::optional<ChatRole> parsed =
      role->is_string() ? role_of(role->get<std::string>(), style) : std::nullopt;
  DSTRAIN_USER_CHECK(parsed.has_value())
      << where << ": " << name << " has the " << style.role_key << " " << role->dump()
      << "; the accepted ones are " << style.accepted_roles << ".";
  const auto content = message.find(style.content_key);
  DSTRAIN_USER_CHECK(content != message.end())
      << where << ": " << name << " has no \"" << style.content_key << "\".";
  return ChatMessage{*parsed, content_text(*content, index, style, where)};
}

bool is_blank(std::string_view line) {
  return line.find_first_not_of(" \t\r\n\f\v") == std::string_view::npos;
}

}  // namespace

std::optional<std::vector<ChatMessage>> parse_chat_line(std::string_view line,
                                                        const std::string& where) {
  if (is_blank(line)) return std::nullopt;
  const json record = json::parse(line, nullptr, /*allow_exceptions=*/false);
  DSTRAIN_USER_CHECK(!record.is_discarded())
      << where << " is not valid JSON (or not UTF-8); each line must be one JSON object.";
  DSTRAIN_USER_CHECK(record.is_object())
      << where << " is a JSON " << record.type_name() << ", not an object with \"messages\" "
      << "or \"conversations\".";
  const ChatStyle& style = record.contains(kOpenAi.list_key) ? kOpenAi : kShareGpt;
  const auto list = record.find(style.list_key);
  DSTRAIN_USER_CHECK(list != record.end())
      << where << " has neither \"messages\" (OpenAI style) nor \"conversations\" (ShareGPT "
      << "style).";
  DSTRAIN_USER_CHECK(list->is_array())
      << where << ": \"" << style.list_key << "\" is " << list->type_name() << ", not a list.";
  std::vector<ChatMessage> messages;
  for (size_t i = 0; i < list->size(); ++i)
    messages.push_back(parse_message((*list)[i], i, style, where));
  return messages;
}

ChatJsonlReader::ChatJsonlReader(const std::string& path) : path_(path) {
  DSTRAIN_USER_CHECK(!std::filesystem::is_directory(path))
      << path << " is a directory; pass a JSONL file of conversations.";
  in_.open(path, std::ios::binary);
  DSTRAIN_USER_CHECK(in_.is_open()) << "cannot open " << path << "; check that it exists.";
}

std::optional<ChatRecord> ChatJsonlReader::next() {
  std::string line;
  while (std::getline(in_, line)) {
    ++line_;
    std::optional<std::vector<ChatMessage>> messages =
        parse_chat_line(line, path_ + ":" + std::to_string(line_));
    if (messages) return ChatRecord{line_, std::move(*messages)};
  }
  DSTRAIN_USER_CHECK(!in_.bad()) << "reading " << path_ << " failed after line " << line_ << ".";
  return std::nullopt;
}

}  // namespace dstrain
