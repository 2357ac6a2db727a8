// Conversations for fine-tuning, read from JSONL: one JSON object a line, in either style
//   OpenAI    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
//   ShareGPT  {"conversations": [{"from": "system"|"human"|"gpt" (or "user"|"assistant"),
//                                 "value": "..."}, ...]}
// Other keys (of the line or of a message) are ignored. A content may also be a list of
// {"type": "text", "text": "..."} parts, which are joined without a separator (transformers
// would hand the list itself to the template; every known template would then render its
// Python repr). Blank lines (only whitespace) are skipped.
#pragma once

#include <cstddef>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_template.h"

namespace dstrain {

// One JSONL line as a conversation; std::nullopt for a blank line. Throws UserError, one
// sentence starting with `where` ("train.jsonl:12"), when the line is not a JSON object, has
// neither "messages" nor "conversations" (or it is not a list), or a message is not an
// object, lacks its role ("role"/"from") or content ("content"/"value"), has a role that is
// not one of the accepted ones, or a content that is not a string or a list of text parts.
std::optional<std::vector<ChatMessage>> parse_chat_line(std::string_view line,
                                                        const std::string& where);

struct ChatRecord {
  size_t line = 0;  // 1-based line number in the file
  std::vector<ChatMessage> messages;
};

// Streams the conversations of a JSONL file one line at a time, so the file may be larger
// than memory. Not thread-safe.
class ChatJsonlReader {
 public:
  // Throws UserError naming the path when it is missing, a directory or unreadable.
  explicit ChatJsonlReader(const std::string& path);

  // The next conversation (blank lines skipped), or std::nullopt at the end of the file.
  // Throws what parse_chat_line throws, with "<path>:<line>" as `where`.
  std::optional<ChatRecord> next();

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ifstream in_;
  size_t line_ = 0;
};

}  // namespace dstrain
