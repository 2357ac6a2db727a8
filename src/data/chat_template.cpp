#include "data/chat_template.h"

#include <array>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/check.h"
#include "core/fs.h"

namespace dstrain {

namespace {

using nlohmann::json;

// ---- names ---------------------------------------------------------------------------------

struct KnownTemplate {
  ChatTemplateKind kind;
  std::string name;
  std::string bos_token;  // as the family's tokenizer_config.json names them
  std::string eos_token;
};

const std::vector<KnownTemplate>& known_templates() {
  static const std::vector<KnownTemplate> table = {
      {ChatTemplateKind::kLlama3, "llama3", "<|begin_of_text|>", "<|eot_id|>"},
      {ChatTemplateKind::kLlama31, "llama3.1", "<|begin_of_text|>", "<|eot_id|>"},
      {ChatTemplateKind::kQwen2, "qwen2", "", "<|im_end|>"},
      {ChatTemplateKind::kQwen25, "qwen2.5", "", "<|im_end|>"},
      {ChatTemplateKind::kDeepSeekLlm, "deepseek-llm", "<｜begin▁of▁sentence｜>",
       "<｜end▁of▁sentence｜>"},
      {ChatTemplateKind::kDeepSeekV3, "deepseek-v3", "<｜begin▁of▁sentence｜>",
       "<｜end▁of▁sentence｜>"},
      {ChatTemplateKind::kDeepSeekR1, "deepseek-r1", "<｜begin▁of▁sentence｜>",
       "<｜end▁of▁sentence｜>"},
      {ChatTemplateKind::kMistralLegacy, "mistral-legacy", "<s>", "</s>"},
      {ChatTemplateKind::kMistralV1, "mistral-v1", "<s>", "</s>"},
      {ChatTemplateKind::kMistralV3, "mistral-v3", "<s>", "</s>"},
  };
  return table;
}

const KnownTemplate& known_template(ChatTemplateKind kind) {
  return known_templates().at(static_cast<size_t>(kind));
}

std::string joined_names() {
  std::string out;
  for (const std::string& name : chat_template_names()) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// ---- canonical Jinja text ------------------------------------------------------------------
// The template as a string in which formatting that cannot change the output is gone: every
// tag is `{{code}}` or `{%code%}` with the code's whitespace removed (one space kept between two
// words), strings re-quoted as '...' with their escapes decoded and re-escaped one way,
// `a.b` written `a['b']`, comments dropped, and the text between tags, after Jinja's
// whitespace control and transformers' trim_blocks / lstrip_blocks, written as {{'text'}}.

constexpr std::string_view kJinjaSpace = " \t\n\r\f\v";

std::string jinja_quoted(std::string_view text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\\' || c == '\'') out += '\\';
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c == '\r')
      out += "\\r";
    else
      out += c;
  }
  return out + "'";
}

// The string literal starting at body[begin] (a quote), decoded; sets `end` past it.
std::string read_string(std::string_view body, size_t begin, size_t& end) {
  const char quote = body[begin];
  std::string value;
  size_t i = begin + 1;
  for (; i < body.size() && body[i] != quote; ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      value += body[i];
      continue;
    }
    const char next = body[++i];
    if (next == 'n')
      value += '\n';
    else if (next == 't')
      value += '\t';
    else if (next == 'r')
      value += '\r';
    else if (next == '\\' || next == '\'' || next == '"')
      value += next;
    else
      value += std::string("\\") + next;
  }
  end = i + 1;
  return value;
}

bool is_word_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

std::string canonical_code(std::string_view body) {
  enum Previous { kOther, kWord, kValue, kDot } previous = kOther;
  std::string out;
  size_t i = 0;
  while (i < body.size()) {
    const char c = body[i];
    if (kJinjaSpace.find(c) != std::string_view::npos) {
      ++i;
    } else if (c == '\'' || c == '"') {
      out += jinja_quoted(read_string(body, i, i));
      previous = kValue;
    } else if (is_word_char(c)) {
      size_t end = i;
      while (end < body.size() && is_word_char(body[end])) ++end;
      const std::string_view word = body.substr(i, end - i);
      if (previous == kDot && !(word[0] >= '0' && word[0] <= '9')) {
        out.pop_back();  // the '.'
        out += "['" + std::string(word) + "']";
        previous = kValue;
      } else {
        if (previous == kWord) out += ' ';
        out += word;
        previous = kWord;
      }
      i = end;
    } else {
      out += c;
      previous = c == '.' && previous != kOther ? kDot : (c == ']' || c == ')') ? kValue : kOther;
      ++i;
    }
  }
  return out;
}

struct TagSide {
  bool strip = false;  // a '-' whitespace-control mark on this side
  char kind = '{';     // '{' expression, '%' statement, '#' comment
};

// The text between two tags after whitespace control, trim_blocks and lstrip_blocks.
std::string output_text(std::string_view text, const std::optional<TagSide>& before,
                        const std::optional<TagSide>& after) {
  std::string out(text);
  if (before && before->strip) {
    out.erase(0, std::min(out.size(), out.find_first_not_of(kJinjaSpace)));
  } else if (before && before->kind != '{' && !out.empty() && out[0] == '\n') {
    out.erase(0, 1);
  }
  if (after && after->strip) {
    const size_t last = out.find_last_not_of(kJinjaSpace);
    out.erase(last == std::string::npos ? 0 : last + 1);
  } else if (after && after->kind != '{') {
    const size_t newline = out.rfind('\n');
    const size_t line = newline == std::string::npos ? 0 : newline + 1;
    const bool at_line_start = newline != std::string::npos || !before;
    if (at_line_start && out.find_first_not_of(" \t", line) == std::string::npos) out.erase(line);
  }
  return out;
}

// Where the tag whose body starts at `begin` closes (the index of its closing delimiter).
size_t tag_close(std::string_view text, size_t begin, char kind) {
  const std::string_view close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
  char quote = 0;
  for (size_t i = begin; i < text.size(); ++i) {
    if (quote != 0) {
      if (text[i] == '\\')
        ++i;
      else if (text[i] == quote)
        quote = 0;
    } else if (kind != '#' && (text[i] == '\'' || text[i] == '"')) {
      quote = text[i];
    } else if (text.substr(i, 2) == close) {
      return i;
    }
  }
  return std::string_view::npos;
}

void append_text(std::string& out, std::string_view text, const std::optional<TagSide>& before,
                 const std::optional<TagSide>& after) {
  const std::string emitted = output_text(text, before, after);
  if (!emitted.empty()) out += "{{" + jinja_quoted(emitted) + "}}";
}

std::string canonical_template(std::string_view text) {
  std::string out;
  std::optional<TagSide> previous;
  size_t pos = 0;
  while (true) {
    size_t open = text.find('{', pos);
    while (open != std::string_view::npos && open + 1 < text.size() &&
           std::string_view("{%#").find(text[open + 1]) == std::string_view::npos)
      open = text.find('{', open + 1);
    if (open == std::string_view::npos || open + 1 >= text.size()) {
      append_text(out, text.substr(pos), previous, std::nullopt);
      return out;
    }
    TagSide opening{false, text[open + 1]};
    size_t body = open + 2;
    if (body < text.size() && (text[body] == '-' || text[body] == '+'))
      opening.strip = text[body++] == '-';
    append_text(out, text.substr(pos, open - pos), previous, opening);
    const size_t close = tag_close(text, body, opening.kind);
    if (close == std::string_view::npos) return out + "<unclosed tag>";
    std::string_view code = text.substr(body, close - body);
    TagSide closing{false, opening.kind};
    if (!code.empty() && (code.back() == '-' || code.back() == '+')) {
      closing.strip = code.back() == '-';
      code.remove_suffix(1);
    }
    if (opening.kind == '{') out += "{{" + canonical_code(code) + "}}";
    if (opening.kind == '%') out += "{%" + canonical_code(code) + "%}";
    previous = closing;
    pos = close + 2;
  }
}

// ---- recognition ---------------------------------------------------------------------------
// Each template is known by the canonical pieces that decide what it renders for system, user
// and assistant messages; a text must hold all of them. The pieces of different templates
// exclude each other (a template's string literals, spacing, trim and conditions differ).

struct Signature {
  ChatTemplateKind kind;
  std::vector<std::string_view> pieces;
};

const std::vector<Signature>& signatures() {
  static const std::vector<Signature> table =
      {
          {ChatTemplateKind::kLlama3,
           {R"({%set loop_messages=messages%}{%for message in loop_messages%}{%set content='<|start_header_id|>'+message['role']+'<|end_header_id|>\n\n'+message['content']|trim+'<|eot_id|>'%}{%if loop['index0']==0%}{%set content=bos_token+content%}{%endif%}{{content}}{%endfor%})",
            R"({%if add_generation_prompt%}{{'<|start_header_id|>assistant<|end_header_id|>\n\n'}}{%endif%})"}},
          {ChatTemplateKind::kLlama31,
           {R"({%set date_string='26 Jul 2024'%})",
            R"({%if messages[0]['role']=='system'%}{%set system_message=messages[0]['content']|trim%}{%set messages=messages[1:]%}{%else%}{%set system_message=''%}{%endif%}{{'<|start_header_id|>system<|end_header_id|>\n\n'}})",
            R"({{'Cutting Knowledge Date: December 2023\n'}}{{'Today Date: '+date_string+'\n\n'}})",
            R"({{system_message}}{{'<|eot_id|>'}})",
            R"({%for message in messages%}{%if not(message['role']=='ipython'or message['role']=='tool'or'tool_calls'in message)%}{{'<|start_header_id|>'+message['role']+'<|end_header_id|>\n\n'+message['content']|trim+'<|eot_id|>'}})",
            R"({%if add_generation_prompt%}{{'<|start_header_id|>assistant<|end_header_id|>\n\n'}}{%endif%})"}},
          {ChatTemplateKind::kQwen2,
           {R"({%for message in messages%}{%if loop['first']and messages[0]['role']!='system'%}{{'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n'}}{%endif%}{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>'+'\n'}}{%endfor%})",
            R"({%if add_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%})"}},
          {ChatTemplateKind::kQwen25,
           {R"({%if tools%}{{'<|im_start|>system\n'}})",
            R"({%else%}{%if messages[0]['role']=='system'%}{{'<|im_start|>system\n'+messages[0]['content']+'<|im_end|>\n'}}{%else%}{{'<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n'}}{%endif%}{%endif%})",
            R"({%for message in messages%}{%if(message['role']=='user')or(message['role']=='system'and not loop['first'])or(message['role']=='assistant'and not message['tool_calls'])%}{{'<|im_start|>'+message['role']+'\n'+message['content']+'<|im_end|>'+'\n'}})",
            R"({%if add_generation_prompt%}{{'<|im_start|>assistant\n'}}{%endif%})"}},
          {ChatTemplateKind::kDeepSeekLlm,
           {R"({{bos_token}}{%for message in messages%}{%if message['role']=='user'%}{{'User: '+message['content']+'\n\n'}}{%elif message['role']=='assistant'%}{{'Assistant: '+message['content']+eos_token}}{%elif message['role']=='system'%}{{message['content']+'\n\n'}}{%endif%}{%endfor%}{%if add_generation_prompt%}{{'Assistant:'}}{%endif%})"}},
          {ChatTemplateKind::kDeepSeekV3,
           {R"({%if message['role']=='system'%}{%if ns['is_first_sp']%}{%set ns['system_prompt']=ns['system_prompt']+message['content']%}{%set ns['is_first_sp']=false%}{%else%}{%set ns['system_prompt']=ns['system_prompt']+'\n\n'+message['content']%}{%endif%}{%endif%}{%endfor%}{{bos_token}}{{ns['system_prompt']}})",
            R"({%if message['role']=='user'%}{%set ns['is_tool']=false%}{{'<｜User｜>'+message['content']}}{%endif%})",
            R"({%else%}{{'<｜Assistant｜>'+message['content']+'<｜end▁of▁sentence｜>'}}{%endif%}{%endif%})",
            R"({%if add_generation_prompt and not ns['is_tool']%}{{'<｜Assistant｜>'}}{%endif%})"}},
          {ChatTemplateKind::kDeepSeekR1,
           {R"({%if message['role']=='system'%}{%if ns['is_first_sp']%}{%set ns['system_prompt']=ns['system_prompt']+message['content']%}{%set ns['is_first_sp']=false%}{%else%}{%set ns['system_prompt']=ns['system_prompt']+'\n\n'+message['content']%}{%endif%}{%endif%}{%endfor%}{{bos_token}}{{ns['system_prompt']}})",
            R"({%if message['role']=='user'%}{%set ns['is_tool']=false%}{{'<｜User｜>'+message['content']}}{%endif%})", R"({%else%}{%set content=message['content']%}{%if'</think>'in content%}{%set content=content['split']('</think>')[-1]%}{%endif%}{{'<｜Assistant｜>'+content+'<｜end▁of▁sentence｜>'}}{%endif%}{%endif%})",
            R"({%if add_generation_prompt and not ns['is_tool']%}{{'<｜Assistant｜>'}}{%endif%})"}},
          {ChatTemplateKind::kMistralLegacy,
           {R"({{bos_token}}{%for message in messages%}{%if(message['role']=='user')!=(loop['index0']%2==0)%}{{raise_exception()",
            R"({%if message['role']=='user'%}{{'[INST] '+message['content']+' [/INST]'}}{%elif message['role']=='assistant'%}{{message['content']+eos_token}}{%else%}{{raise_exception()"}},
          {ChatTemplateKind::kMistralV1,
           {R"({%if messages[0]['role']=='system'%}{%set system_message=messages[0]['content']%}{%set loop_messages=messages[1:]%}{%else%}{%set loop_messages=messages%}{%endif%}{{bos_token}}{%for message in loop_messages%}{%if(message['role']=='user')!=(loop['index0']%2==0)%}{{raise_exception()",
            R"({%if message['role']=='user'%}{%if loop['first']and system_message is defined%}{{' [INST] '+system_message+'\n\n'+message['content']+' [/INST]'}}{%else%}{{' [INST] '+message['content']+' [/INST]'}}{%endif%}{%elif message['role']=='assistant'%}{{' '+message['content']+eos_token}}{%else%}{{raise_exception()"}},
          {ChatTemplateKind::kMistralV3,
           {R"({%if messages[0]['role']=='system'%}{%set system_message=messages[0]['content']%}{%set loop_messages=messages[1:]%}{%else%}{%set loop_messages=messages%}{%endif%})",
            R"({%if(message['role']=='user')!=(ns['index']%2==0)%}{{raise_exception()",
            R"({{bos_token}}{%for message in loop_messages%}{%if message['role']=='user'%})",
            R"({%if loop['last']and system_message is defined%}{{'[INST] '+system_message+'\n\n'+message['content']+'[/INST]'}}{%else%}{{'[INST] '+message['content']+'[/INST]'}}{%endif%})",
            R"({%elif message['role']=='assistant'%}{{' '+message['content']|trim+eos_token}})",
            R"({%else%}{{raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!')}}{%endif%}{%endfor%})"}},
      };
  return table;
}

bool matches(const std::string& canonical, const Signature& signature) {
  for (std::string_view piece : signature.pieces)
    if (canonical.find(piece) == std::string::npos) return false;
  return true;
}

// ---- tokenizer_config.json -----------------------------------------------------------------

// A special token as tokenizer_config.json writes it: a string or {"content": "..."}.
std::optional<std::string> token_field(const json& config, const char* key) {
  const auto found = config.find(key);
  if (found == config.end()) return std::nullopt;
  if (found->is_string()) return found->get<std::string>();
  if (found->is_object() && found->contains("content") && (*found)["content"].is_string())
    return (*found)["content"].get<std::string>();
  return std::nullopt;
}

// The chat_template field's text: a string, or the "default" of a list of {name, template}.
std::optional<std::string> template_field(const json& config, const std::string& path) {
  const auto found = config.find("chat_template");
  if (found == config.end() || found->is_null()) return std::nullopt;
  if (found->is_string()) return found->get<std::string>();
  DSTRAIN_USER_CHECK(found->is_array())
      << path << ": chat_template is neither a string nor a list of {\"name\", \"template\"} "
      << "objects; pass --chat-template NAME|FILE (" << joined_names() << ").";
  for (const json& entry : *found) {
    if (entry.is_object() && entry.value("name", json()) == "default" &&
        entry.contains("template") && entry["template"].is_string())
      return entry["template"].get<std::string>();
  }
  DSTRAIN_USER_ERROR() << path << ": chat_template is a list with no \"default\" template; "
                       << "pass --chat-template NAME|FILE (" << joined_names() << ").";
}

std::optional<json> read_config(const std::string& tokenizer_dir, std::string& path) {
  path = (std::filesystem::path(tokenizer_dir) / "tokenizer_config.json").string();
  if (tokenizer_dir.empty() || !std::filesystem::is_regular_file(path)) return std::nullopt;
  json config = json::parse(read_file(path), nullptr, /*allow_exceptions=*/false);
  DSTRAIN_USER_CHECK(config.is_object())
      << path << " is not a JSON object; point at a Hugging Face tokenizer directory.";
  return config;
}

ChatTemplateKind kind_from_override(const std::string& override) {
  for (const KnownTemplate& known : known_templates())
    if (known.name == override) return known.kind;
  DSTRAIN_USER_CHECK(std::filesystem::is_regular_file(override))
      << "--chat-template " << override << " is neither a known template (" << joined_names()
      << ") nor a file holding a Jinja chat template.";
  return recognize_chat_template(read_file(override), override);
}

// ---- rendering -----------------------------------------------------------------------------

// Collects the rendering, merging adjacent pieces with the same `trained`.
class Output {
 public:
  void add(std::string_view text, bool trained = false) {
    if (text.empty()) return;
    if (segments_.empty() || segments_.back().trained != trained)
      segments_.push_back({"", trained});
    segments_.back().text += text;
  }
  std::vector<ChatSegment> take() { return std::move(segments_); }

 private:
  std::vector<ChatSegment> segments_;
};

// Python's str.isspace characters, the ones Jinja's `trim` (str.strip()) removes, in UTF-8.
constexpr std::array<std::string_view, 29> kPythonSpaces = {
    "\t",           "\n",           "\v",           "\f",           "\r",
    "\x1c",         "\x1d",         "\x1e",         "\x1f",         " ",
    "\xc2\x85",     "\xc2\xa0",     "\xe1\x9a\x80", "\xe2\x80\x80", "\xe2\x80\x81",
    "\xe2\x80\x82", "\xe2\x80\x83", "\xe2\x80\x84", "\xe2\x80\x85", "\xe2\x80\x86",
    "\xe2\x80\x87", "\xe2\x80\x88", "\xe2\x80\x89", "\xe2\x80\x8a", "\xe2\x80\xa8",
    "\xe2\x80\xa9", "\xe2\x80\xaf", "\xe2\x81\x9f", "\xe3\x80\x80"};

size_t leading_space(std::string_view text) {
  for (std::string_view space : kPythonSpaces)
    if (text.starts_with(space)) return space.size();
  return 0;
}

size_t trailing_space(std::string_view text) {
  for (std::string_view space : kPythonSpaces)
    if (text.ends_with(space)) return space.size();
  return 0;
}

// Jinja's `trim`: Python's str.strip().
std::string_view python_strip(std::string_view text) {
  while (size_t n = leading_space(text)) text.remove_prefix(n);
  while (size_t n = trailing_space(text)) text.remove_suffix(n);
  return text;
}

const char* role_name(ChatRole role) {
  return role == ChatRole::kSystem ? "system" : role == ChatRole::kUser ? "user" : "assistant";
}

std::string a_role(ChatRole role) {
  return std::string(role == ChatRole::kAssistant ? "an " : "a ") + role_name(role);
}

void render_llama3(const ChatTemplate& t, std::span<const ChatMessage> messages, bool prompt,
                   Output& out) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    out.add((i == 0 ? t.bos_token : "") + "<|start_header_id|>" + role_name(m.role) +
            "<|end_header_id|>\n\n");
    const bool trained = m.role == ChatRole::kAssistant;
    out.add(python_strip(m.content), trained);
    out.add("<|eot_id|>", trained);
  }
  if (prompt) out.add("<|start_header_id|>assistant<|end_header_id|>\n\n");
}

void render_llama31(const ChatTemplate& t, std::span<const ChatMessage> messages, bool prompt,
                    Output& out) {
  const bool has_system = messages[0].role == ChatRole::kSystem;
  out.add(t.bos_token + "<|start_header_id|>system<|end_header_id|>\n\n" +
          "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n");
  if (has_system) out.add(python_strip(messages[0].content));
  out.add("<|eot_id|>");
  render_llama3(ChatTemplate{t.kind, "", t.eos_token}, messages.subspan(has_system ? 1 : 0), prompt,
                out);
}

void render_chatml(std::string_view default_system, std::span<const ChatMessage> messages,
                   bool prompt, Output& out) {
  if (messages[0].role != ChatRole::kSystem)
    out.add("<|im_start|>system\n" + std::string(default_system) + "<|im_end|>\n");
  for (const ChatMessage& m : messages) {
    const bool trained = m.role == ChatRole::kAssistant;
    out.add(std::string("<|im_start|>") + role_name(m.role) + "\n");
    out.add(m.content, trained);
    out.add("<|im_end|>", trained);
    out.add("\n");
  }
  if (prompt) out.add("<|im_start|>assistant\n");
}

void render_deepseek_llm(const ChatTemplate& t, std::span<const ChatMessage> messages, bool prompt,
                         Output& out) {
  out.add(t.bos_token);
  for (const ChatMessage& m : messages) {
    if (m.role == ChatRole::kUser) out.add("User: " + m.content + "\n\n");
    if (m.role == ChatRole::kSystem) out.add(m.content + "\n\n");
    if (m.role != ChatRole::kAssistant) continue;
    out.add("Assistant: ");
    out.add(m.content, true);
    out.add(t.eos_token, true);
  }
  if (prompt) out.add("Assistant:");
}

// What DeepSeek-R1's template keeps of an assistant message: what follows the last </think>.
std::string_view after_thinking(std::string_view content) {
  const size_t end = content.rfind("</think>");
  return end == std::string_view::npos ? content : content.substr(end + 8);
}

void render_deepseek_v3(const ChatTemplate& t, std::span<const ChatMessage> messages, bool prompt,
                        Output& out) {
  std::string system;
  bool first_system = true;
  for (const ChatMessage& m : messages) {
    if (m.role != ChatRole::kSystem) continue;
    system += (first_system ? "" : "\n\n") + m.content;
    first_system = false;
  }
  out.add(t.bos_token + system);
  for (const ChatMessage& m : messages) {
    if (m.role == ChatRole::kUser) out.add("<｜User｜>" + m.content);
    if (m.role != ChatRole::kAssistant) continue;
    out.add("<｜Assistant｜>");
    const bool r1 = t.kind == ChatTemplateKind::kDeepSeekR1;
    out.add(r1 ? after_thinking(m.content) : std::string_view(m.content), true);
    out.add("<｜end▁of▁sentence｜>", true);
  }
  if (prompt) out.add("<｜Assistant｜>");
}

// The three [INST] templates differ in spacing, trim and where the system message goes.
struct MistralStyle {
  std::string_view open;              // before a user turn's text
  std::string_view close;             // after it
  std::string_view assistant_prefix;  // before an assistant turn's text
  bool trim_assistant;
  enum { kNoSystem, kFirstUser, kLastMessageUser } system;
};

MistralStyle mistral_style(ChatTemplateKind kind) {
  if (kind == ChatTemplateKind::kMistralLegacy)
    return {"[INST] ", " [/INST]", "", false, MistralStyle::kNoSystem};
  if (kind == ChatTemplateKind::kMistralV1)
    return {" [INST] ", " [/INST]", " ", false, MistralStyle::kFirstUser};
  return {"[INST] ", "[/INST]", " ", true, MistralStyle::kLastMessageUser};
}

// Refuses what the [INST] templates raise on: a system message that is not first (any, for
// mistral-legacy) and turns that do not alternate user, assistant, user, ...
void check_mistral_turns(const ChatTemplate& t, std::span<const ChatMessage> turns,
                         size_t first_index, const std::string& where) {
  const std::string& name = chat_template_name(t.kind);
  for (size_t i = 0; i < turns.size(); ++i) {
    DSTRAIN_USER_CHECK(turns[i].role != ChatRole::kSystem)
        << where << ": message " << i + first_index + 1 << " is a system message, which the "
        << name << " chat template "
        << (t.kind == ChatTemplateKind::kMistralLegacy ? "does not accept."
                                                       : "accepts only as the first message.");
    const ChatRole expected = i % 2 == 0 ? ChatRole::kUser : ChatRole::kAssistant;
    DSTRAIN_USER_CHECK(turns[i].role == expected)
        << where << ": message " << i + first_index + 1 << " is " << a_role(turns[i].role)
        << " turn where the " << name << " chat template needs " << a_role(expected)
        << " turn (user and assistant turns must alternate, starting with a user turn).";
  }
}

void render_mistral(const ChatTemplate& t, std::span<const ChatMessage> messages,
                    const std::string& where, Output& out) {
  const MistralStyle style = mistral_style(t.kind);
  const bool has_system =
      style.system != MistralStyle::kNoSystem && messages[0].role == ChatRole::kSystem;
  const std::span<const ChatMessage> turns = messages.subspan(has_system ? 1 : 0);
  check_mistral_turns(t, turns, has_system ? 1 : 0, where);
  out.add(t.bos_token);
  for (size_t i = 0; i < turns.size(); ++i) {
    const ChatMessage& m = turns[i];
    if (m.role == ChatRole::kUser) {
      const bool with_system =
          has_system && (style.system == MistralStyle::kFirstUser ? i == 0 : i + 1 == turns.size());
      out.add(std::string(style.open) + (with_system ? messages[0].content + "\n\n" : "") +
              m.content + std::string(style.close));
      continue;
    }
    out.add(style.assistant_prefix);
    out.add(style.trim_assistant ? python_strip(m.content) : std::string_view(m.content), true);
    out.add(t.eos_token, true);
  }
}

}  // namespace

// ---- public --------------------------------------------------------------------------------

const std::vector<std::string>& chat_template_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const KnownTemplate& known : known_templates()) out.push_back(known.name);
    return out;
  }();
  return names;
}

const std::string& chat_template_name(ChatTemplateKind kind) { return known_template(kind).name; }

ChatTemplateKind chat_template_kind(std::string_view name) {
  for (const KnownTemplate& known : known_templates())
    if (known.name == name) return known.kind;
  DSTRAIN_USER_ERROR() << "\"" << name << "\" is not a known chat template; the known ones are "
                       << joined_names() << ".";
}

ChatTemplate default_chat_template(ChatTemplateKind kind) {
  const KnownTemplate& known = known_template(kind);
  return ChatTemplate{kind, known.bos_token, known.eos_token};
}

ChatTemplateKind recognize_chat_template(std::string_view jinja_text, const std::string& source) {
  const std::string canonical = canonical_template(jinja_text);
  std::optional<ChatTemplateKind> found;
  size_t matched = 0;
  for (const Signature& signature : signatures()) {
    if (!matches(canonical, signature)) continue;
    found = signature.kind;
    ++matched;
  }
  DSTRAIN_USER_CHECK(matched == 1)
      << source << " holds a chat template dstrain does not recognise; name one of the known "
      << "templates (" << joined_names() << ") with --chat-template NAME, or pass "
      << "--chat-template FILE with a Jinja file of one of them.";
  return *found;
}

ChatTemplate load_chat_template(const std::string& tokenizer_dir, const std::string& override) {
  std::string path;
  const std::optional<json> config = read_config(tokenizer_dir, path);
  ChatTemplateKind kind;
  if (!override.empty()) {
    kind = kind_from_override(override);
  } else {
    DSTRAIN_USER_CHECK(config.has_value())
        << path << " does not exist; point at a Hugging Face tokenizer directory, or pass "
        << "--chat-template NAME|FILE (" << joined_names() << ").";
    const std::optional<std::string> text = template_field(*config, path);
    DSTRAIN_USER_CHECK(text.has_value())
        << path << " has no chat_template; pass --chat-template NAME|FILE (" << joined_names()
        << ").";
    kind = recognize_chat_template(*text, path);
  }
  ChatTemplate chat_template = default_chat_template(kind);
  if (config) {
    chat_template.bos_token = token_field(*config, "bos_token").value_or(chat_template.bos_token);
    chat_template.eos_token = token_field(*config, "eos_token").value_or(chat_template.eos_token);
  }
  return chat_template;
}

std::vector<ChatSegment> render_chat(const ChatTemplate& chat_template,
                                     std::span<const ChatMessage> messages,
                                     const std::string& where, bool add_generation_prompt) {
  Output out;
  if (messages.empty()) return out.take();
  switch (chat_template.kind) {
    case ChatTemplateKind::kLlama3:
      render_llama3(chat_template, messages, add_generation_prompt, out);
      break;
    case ChatTemplateKind::kLlama31:
      render_llama31(chat_template, messages, add_generation_prompt, out);
      break;
    case ChatTemplateKind::kQwen2:
      render_chatml("You are a helpful assistant.", messages, add_generation_prompt, out);
      break;
    case ChatTemplateKind::kQwen25:
      render_chatml("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                    messages, add_generation_prompt, out);
      break;
    case ChatTemplateKind::kDeepSeekLlm:
      render_deepseek_llm(chat_template, messages, add_generation_prompt, out);
      break;
    case ChatTemplateKind::kDeepSeekV3:
    case ChatTemplateKind::kDeepSeekR1:
      render_deepseek_v3(chat_template, messages, add_generation_prompt, out);
      break;
    case ChatTemplateKind::kMistralLegacy:
    case ChatTemplateKind::kMistralV1:
    case ChatTemplateKind::kMistralV3:
      render_mistral(chat_template, messages, where, out);  // no generation prompt
      break;
  }
  return out.take();
}

std::string chat_text(std::span<const ChatSegment> segments) {
  std::string text;
  for (const ChatSegment& segment : segments) text += segment.text;
  return text;
}

}  // namespace dstrain
