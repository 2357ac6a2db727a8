// The chat fixtures of tests/reference/chat/ (tests/reference/make_chat_fixtures.py), shared by
// the chat template and prepare --chat tests.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fs.h"
#include "data/bpe_tokenizer.h"
#include "data/chat_template.h"

namespace dstrain::chat_fixtures {

using nlohmann::json;
inline const std::string kChat = std::string(DSTRAIN_SOURCE_DIR) + "/tests/reference/chat/";

inline const json& fixtures() {
  static const json document = json::parse(read_file(kChat + "cases.json"));
  return document;
}

inline std::string template_text(const std::string& file) {
  return read_file(kChat + "templates/" + file);
}

inline std::vector<ChatMessage> messages_of(const json& messages) {
  std::vector<ChatMessage> out;
  for (const json& m : messages) {
    const std::string role = m["role"];
    out.push_back({role == "system" ? ChatRole::kSystem
                   : role == "user" ? ChatRole::kUser
                                    : ChatRole::kAssistant,
                   m["content"]});
  }
  return out;
}

inline const std::vector<ChatMessage>& case_messages(const std::string& name) {
  static std::map<std::string, std::vector<ChatMessage>> cases;
  if (cases.empty())
    for (const json& c : fixtures()["cases"]) cases[c["name"]] = messages_of(c["messages"]);
  return cases.at(name);
}

inline BpeTokenizer& family_tokenizer(const std::string& family) {
  static std::map<std::string, BpeTokenizer> loaded;
  auto found = loaded.find(family);
  if (found == loaded.end())
    found =
        loaded.emplace(family, BpeTokenizer::from_file(kChat + family + "/tokenizer.json")).first;
  return found->second;
}

}  // namespace dstrain::chat_fixtures
