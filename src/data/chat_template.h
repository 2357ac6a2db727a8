// Native chat templates: the Hugging Face chat templates of Llama 3.x, Qwen2/2.5, DeepSeek and
// Mistral/Mixtral, recognised by their Jinja text and rendered without a Jinja engine, exactly
// as transformers 4.41's `tokenizer.apply_chat_template(messages, tokenize=False)` renders
// them, with the characters a fine-tune trains on marked.
//
// Known templates (chat_template_names(); tests/reference/chat/ holds the real texts):
//   llama3          Meta-Llama-3-8B/70B-Instruct
//   llama3.1        Llama 3.1, 3.2 and 3.3 Instruct: the "Cutting Knowledge Date" system header
//                   with the date "26 Jul 2024" (3.2's strftime_now is not defined under
//                   transformers 4.41, so its fallback, the same date, applies)
//   qwen2           Qwen2 Instruct: ChatML, default system "You are a helpful assistant."
//   qwen2.5         Qwen2.5 Instruct: ChatML, default system "You are Qwen, created by Alibaba
//                   Cloud. You are a helpful assistant."
//   deepseek-llm    deepseek-llm-7b/67b-chat, DeepSeek-V2(-Lite)-Chat, DeepSeek-Coder-V2-Lite:
//                   "User: ...\n\nAssistant: ...<eos>"
//   deepseek-v3     DeepSeek-V3: <｜User｜>/<｜Assistant｜>, every system message joined at the
//   start deepseek-r1     DeepSeek-R1 (first release): deepseek-v3 that keeps only what follows the
//                   last "</think>" of an assistant message
//   mistral-legacy  the first [INST] template (Mixtral-8x7B-Instruct-v0.1, Mistral-7B-Instruct
//                   v0.1/v0.2 as first published): no system message
//   mistral-v1      mistralai's "v1" template (Mixtral-8x7B-Instruct-v0.1 today): " [INST] ",
//                   the system message in the first user turn
//   mistral-v3      mistralai's "v3" template (Mistral-7B-Instruct-v0.3, Mistral-Large-2407):
//                   "[INST] ", the system message in the last user turn only when the
//                   conversation ends with it, assistant content trimmed
//
// Trained: each assistant message's content as the template renders it (after its trim or
// </think> cut) and the end-of-turn token that closes it (<|eot_id|>, <|im_end|>, the eos
// <｜end▁of▁sentence｜>, </s>); role headers, system and user turns, and the "\n" after
// <|im_end|> are not trained.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

enum class ChatTemplateKind {
  kLlama3,
  kLlama31,
  kQwen2,
  kQwen25,
  kDeepSeekLlm,
  kDeepSeekV3,
  kDeepSeekR1,
  kMistralLegacy,
  kMistralV1,
  kMistralV3,
};

enum class ChatRole { kSystem, kUser, kAssistant };

struct ChatMessage {
  ChatRole role = ChatRole::kUser;
  std::string content;  // UTF-8
};

// A chat template with the special tokens its text uses as `bos_token` and `eos_token`.
struct ChatTemplate {
  ChatTemplateKind kind = ChatTemplateKind::kLlama31;
  std::string bos_token;
  std::string eos_token;
};

// A piece of a rendered conversation; concatenated, the pieces are the rendering.
struct ChatSegment {
  std::string text;
  bool trained = false;
};

// "llama3", "llama3.1", ...: every known template, in ChatTemplateKind order.
const std::vector<std::string>& chat_template_names();
const std::string& chat_template_name(ChatTemplateKind kind);
// The template with that name, or throws UserError listing the names.
ChatTemplateKind chat_template_kind(std::string_view name);
// The bos and eos tokens the family's own tokenizer_config.json names.
ChatTemplate default_chat_template(ChatTemplateKind kind);

// Which known template a Jinja chat_template text is. The text must hold every piece of code
// that decides what the template renders for system, user and assistant messages (its string
// literals, conditions, filters and the order of the parts), compared with whitespace, quote
// style, "\n" escapes, a.b against a['b'], comments and whitespace control ({%- -%}, and
// transformers' trim_blocks / lstrip_blocks) ignored. Revisions that differ only elsewhere (the
// tool-calling branches, Llama 3.2's strftime_now date) are recognised; one that changes such a
// piece (a default system prompt, a space, a trim, a role header) is not. Throws UserError,
// naming `source` (a file), when the text is none of them: one sentence naming the known
// templates and the --chat-template NAME|FILE override.
ChatTemplateKind recognize_chat_template(std::string_view jinja_text, const std::string& source);

// The template of a Hugging Face tokenizer directory, as a fine-tune renders its data:
//   override empty      DIR/tokenizer_config.json's chat_template (a string, or a list of
//                       {"name", "template"} objects whose "default" is taken), recognised;
//   override a name     that known template;
//   override otherwise  a file holding Jinja text, recognised.
// bos_token and eos_token come from DIR/tokenizer_config.json (strings or {"content": ...}
// objects); where the file or the token is missing, the family's defaults
// (default_chat_template). Throws UserError in one sentence when DIR/tokenizer_config.json is
// missing and there is no override, is not JSON, has no chat_template and there is no
// override, has a chat_template of another type or a list without "default", when the
// override file cannot be read, or when a text is not recognised.
ChatTemplate load_chat_template(const std::string& tokenizer_dir, const std::string& override);

// Renders `messages` as transformers does with this template. With add_generation_prompt the
// assistant header that opens the next turn is appended (what a model generates after; the
// mistral templates have none). Adjacent segments differ in `trained`; an empty conversation
// renders nothing. Throws UserError "<where>: ...", one sentence, where the template raises:
// the mistral templates refuse a system message that is not the first message (any system
// message for mistral-legacy) and user/assistant turns that do not alternate starting with a
// user turn. `where` names the conversation ("train.jsonl:12", "conversation 3"). A
// conversation without an assistant message renders with nothing trained.
std::vector<ChatSegment> render_chat(const ChatTemplate& chat_template,
                                     std::span<const ChatMessage> messages,
                                     const std::string& where, bool add_generation_prompt = false);

// The concatenated text of rendered segments.
std::string chat_text(std::span<const ChatSegment> segments);

}  // namespace dstrain
