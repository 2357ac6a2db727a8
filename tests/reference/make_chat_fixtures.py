#!/usr/bin/env python3
"""Chat-template fixtures for tests/data/chat_template_test.cpp: the real chat templates of
Llama 3/3.1/3.2, Qwen2/2.5, DeepSeek and Mistral/Mixtral, what transformers renders with them,
the ids, and the trained spans.

Regenerate from the repository root (transformers 4.41.2, jinja2, tokenizers):

    /usr/bin/python3 tests/reference/make_chat_fixtures.py

Inputs: tests/reference/chat/templates/*.jinja, the chat_template texts as the model files carry
them, copied byte for byte from these public sources (SOURCES below says which file is which):

  [hfjs-e2e]   huggingface/huggingface.js packages/jinja/test/e2e.test.js (commit fe42e68):
               TEST_CUSTOM_TEMPLATES, keyed by the Hugging Face repository the text was taken from.
  [hfjs-gguf]  huggingface/huggingface.js packages/ollama-utils/src/chat-template-automap.ts
               (commit fe42e68, generated): the `gguf` field, the tokenizer.chat_template that
               llama.cpp's converter copied from the model's tokenizer_config.json. Its Llama 3.1
               text equals [hfjs-e2e]'s byte for byte.
  [llama.cpp]  ggerganov/llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja
               (commit 7b5e080; equal to [hfjs-gguf] llama3.2:3b), and ggml-org/llama.cpp
               tests/test-chat-template.cpp (commit 03f94f1), the test case
               "Mistral-Large-Instruct-2407 (mistralai 'v3' template ...)": the mistralai "v3"
               template, which a third-party script in the same index sets as
               mistralai/Mistral-7B-Instruct-v0.3's template (the same text).
  [r1-files]   zhangbo2008/hf_deepseek_annotated tokenizer_config.json (commit 27141e3): the
               DeepSeek-R1 model files; its chat_template equals [hfjs-e2e] deepseek-ai/DeepSeek-R1.

Writes tests/reference/chat/<family>/ for each FAMILIES entry:
  tokenizer.json          a small BPE trained here with `tokenizers` (a few hundred tokens) of the
                          family's kind: byte-level for Llama 3 (its regex split), Qwen2 (with
                          the NFC normalizer) and DeepSeek (its splits); SentencePiece for
                          Mistral/Mixtral, laid out as their real files (make_tokenizer_fixtures'
                          sentencepiece_kind: <unk> <s> </s>, byte tokens, byte_fallback):
                          Mixtral-8x7B's (v0.1) Prepend("▁") + Replace(" ", "▁") normalizer for
                          mixtral and mixtral-legacy, Mistral-7B-Instruct-v0.3's current
                          Metaspace("▁", prepend_scheme "first", split false) with [INST]
                          [/INST] [TOOL_CALLS] ... as special added tokens for mistral-v0.3;
                          with the tokens the template emits as added tokens
  tokenizer_config.json   the real chat_template, bos_token and eos_token written as the real
                          file writes them (strings, or {"__type": "AddedToken", "content"}
                          objects for DeepSeek) and the real file's other fields that matter
and tests/reference/chat/cases.json: the conversations (CASES) and for every family and case
  text         tokenizer.apply_chat_template(messages, tokenize=False)
  prompt_text  the same with add_generation_prompt=True
  ids          tokenizer.apply_chat_template(messages) (transformers 4.41 encodes the text with
               add_special_tokens=False: checked equal to encode(text, add_special_tokens=False),
               so no second bos is added)
  trained      [begin, end) UTF-8 BYTE offsets into text: each assistant message's content as
               rendered and the end-of-turn token after it, found independently of dstrain: the
               conversation is rendered again with that content replaced by a marker; the text
               before the marker and after it are the same in both renderings, so what lies
               between them in `text` is the rendered content (after the template's trim or
               </think> cut), and the family's end-of-turn token must follow it. (Rendering
               messages[:i] and messages[:i+1] does not work for every template: Mistral's v3
               template puts the system message into the LAST user turn and drops it when an
               assistant turn ends the conversation, so a prefix does not render as a prefix.)
  trained_tokens  per id, 1 when the token's bytes overlap a trained span (the first token:
               0, it is never a target), 0 otherwise: what `dstrain prepare --chat` writes as
               the mask's trained bit. Each token's bytes come from the `tokenizers` library,
               not from dstrain: for the byte-level kinds from its vocabulary (an added token's
               content, or its byte-level string through GPT-2's byte table); for the
               SentencePiece kind from its offsets (return_offsets_mapping, in UTF-8 bytes): a
               "▁" covers its space, so "▁Hello" after "[/INST]" covers the space before the
               content and is trained; a "▁" the tokenizer put before a piece covers the
               piece's first character; every byte token of a character the whole character.
  error        instead of the above, when the template raises (Mistral's alternation check)
"""
import json
import os
import sys

import jinja2
import tokenizers
import transformers
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

transformers.logging.set_verbosity_error()

sys.dont_write_bytecode = True  # no __pycache__ beside the fixtures
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tokenizer_fixtures import (DEEPSEEK_PATTERNS, LLAMA2_NORMALIZER,  # noqa: E402
                                     LLAMA3_PATTERN, MISTRAL_V3_CONTROLS, QWEN2_PATTERN,
                                     corpus_lines, metaspace, sentencepiece_kind)

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "chat")
TEMPLATES = os.path.join(OUT, "templates")

# templates/<file>: (source, the model whose file carries the text)
SOURCES = {
    "llama3.jinja": ("[hfjs-gguf] library/llama3:8b", "meta-llama/Meta-Llama-3-8B-Instruct"),
    "llama3.1.jinja": ("[hfjs-e2e] meta-llama/Llama-3.1-8B-Instruct",
                       "meta-llama/Llama-3.1-8B-Instruct"),
    "llama3.2.jinja": ("[llama.cpp] meta-llama-Llama-3.2-3B-Instruct.jinja",
                       "meta-llama/Llama-3.2-3B-Instruct"),
    "qwen2.jinja": ("[hfjs-gguf] library/qwen2:0.5b", "Qwen/Qwen2-0.5B-Instruct"),
    "qwen2.5.jinja": ("[hfjs-e2e] Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
    "qwen2.5-0.5b.jinja": ("[hfjs-gguf] library/qwen2.5:0.5b (another revision: '{{' in the "
                           "tool text)", "Qwen/Qwen2.5-0.5B-Instruct"),
    # DeepSeek-V2(-Lite)-Chat and DeepSeek-Coder-V2-Lite-Instruct carry the same text
    # ([hfjs-gguf] library/deepseek-coder-v2:16b is byte-identical; llama.cpp's test names it
    # "DeepSeek-V2").
    "deepseek-llm.jinja": ("[hfjs-e2e] deepseek-ai/deepseek-llm-7b-chat",
                           "deepseek-ai/deepseek-llm-7b-chat"),
    "deepseek-v3.jinja": ("[hfjs-gguf] library/deepseek-v3:671b", "deepseek-ai/DeepSeek-V3"),
    "deepseek-r1.jinja": ("[r1-files] tokenizer_config.json", "deepseek-ai/DeepSeek-R1"),
    "deepseek-r1-0528.jinja": ("[hfjs-gguf] library/deepseek-r1:latest (a later R1 revision "
                               "that renders differently: dstrain refuses it)",
                               "deepseek-ai/DeepSeek-R1-0528"),
    "mixtral.jinja": ("[hfjs-gguf] library/mixtral:8x7b (the current file, with a system "
                      "message)", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    "mixtral-legacy.jinja": ("[hfjs-e2e] mistralai/Mixtral-8x7B-Instruct-v0.1 (the first file, "
                             "no system message)", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    "mistral-v0.3.jinja": ("[llama.cpp] tests/test-chat-template.cpp, mistralai 'v3' template",
                           "mistralai/Mistral-7B-Instruct-v0.3"),
    "mixtral-8x22b.jinja": ("[hfjs-gguf] library/mixtral:8x22b (v3 without trim: refused)",
                            "mistralai/Mixtral-8x22B-Instruct-v0.1"),
    "mistral-v0.3-2024-05.jinja": ("[hfjs-e2e] mistralai/Mistral-7B-Instruct-v0.3 (JSON "
                                   "Schema), an earlier revision: refused",
                                   "mistralai/Mistral-7B-Instruct-v0.3"),
}

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK_SPECIALS = [DEEPSEEK_BOS, DEEPSEEK_EOS]
DEEPSEEK3_SPECIALS = DEEPSEEK_SPECIALS + ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>"]


def deepseek_token(content):
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
            "rstrip": False, "single_word": False}


LLAMA3_CONFIG = {"bos_token": "<|begin_of_text|>", "clean_up_tokenization_spaces": True,
                 "eos_token": "<|eot_id|>",
                 "model_input_names": ["input_ids", "attention_mask"],
                 "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
QWEN2_CONFIG = {"add_prefix_space": False,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
                "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
                "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
                "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None}
DEEPSEEK_CONFIG = {"add_bos_token": True, "add_eos_token": False,
                   "bos_token": deepseek_token(DEEPSEEK_BOS),
                   "clean_up_tokenization_spaces": False,
                   "eos_token": deepseek_token(DEEPSEEK_EOS), "legacy": True,
                   "model_max_length": 16384, "pad_token": deepseek_token(DEEPSEEK_EOS),
                   "sp_model_kwargs": {}, "unk_token": None,
                   "tokenizer_class": "LlamaTokenizerFast"}
MISTRAL_CONFIG = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>",
                  "clean_up_tokenization_spaces": False, "eos_token": "</s>", "legacy": False,
                  "model_max_length": 1000000000000000019884624838656, "pad_token": None,
                  "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
                  "tokenizer_class": "LlamaTokenizer", "unk_token": "<unk>",
                  "use_default_system_prompt": False}

# family directory: (template file, dstrain's template name, tokenizer kind, added tokens,
#                    tokenizer_config fields, end-of-turn token)
FAMILIES = {
    "llama3": ("llama3.jinja", "llama3", "llama3", LLAMA3_SPECIALS, LLAMA3_CONFIG, "<|eot_id|>"),
    "llama3.1": ("llama3.1.jinja", "llama3.1", "llama3", LLAMA3_SPECIALS, LLAMA3_CONFIG,
                 "<|eot_id|>"),
    "llama3.2": ("llama3.2.jinja", "llama3.1", "llama3", LLAMA3_SPECIALS, LLAMA3_CONFIG,
                 "<|eot_id|>"),
    "qwen2": ("qwen2.jinja", "qwen2", "qwen2", QWEN2_SPECIALS, QWEN2_CONFIG, "<|im_end|>"),
    "qwen2.5": ("qwen2.5.jinja", "qwen2.5", "qwen2", QWEN2_SPECIALS,
                dict(QWEN2_CONFIG, model_max_length=131072), "<|im_end|>"),
    "deepseek-llm": ("deepseek-llm.jinja", "deepseek-llm", "deepseek", DEEPSEEK_SPECIALS,
                     dict(DEEPSEEK_CONFIG, model_max_length=4096, pad_token=None),
                     DEEPSEEK_EOS),
    "deepseek-v3": ("deepseek-v3.jinja", "deepseek-v3", "deepseek", DEEPSEEK3_SPECIALS,
                    DEEPSEEK_CONFIG, DEEPSEEK_EOS),
    "deepseek-r1": ("deepseek-r1.jinja", "deepseek-r1", "deepseek", DEEPSEEK3_SPECIALS,
                    DEEPSEEK_CONFIG, DEEPSEEK_EOS),
    "mixtral": ("mixtral.jinja", "mistral-v1", "sentencepiece-v0.1", MISTRAL_SPECIALS,
                dict(MISTRAL_CONFIG, legacy=True), "</s>"),
    "mixtral-legacy": ("mixtral-legacy.jinja", "mistral-legacy", "sentencepiece-v0.1",
                       MISTRAL_SPECIALS, dict(MISTRAL_CONFIG, legacy=True), "</s>"),
    "mistral-v0.3": ("mistral-v0.3.jinja", "mistral-v3", "sentencepiece-v0.3",
                     MISTRAL_SPECIALS + MISTRAL_V3_CONTROLS, MISTRAL_CONFIG, "</s>"),
}


def msg(role, content):
    return {"role": role, "content": content}


CASES = [
    ("system_multi_turn", [msg("system", "You are a terse assistant."),
                           msg("user", "Hi there!"), msg("assistant", "Hello! How can I help?"),
                           msg("user", "What is 2+2?"), msg("assistant", "4.")]),
    ("no_system", [msg("user", "Name a colour."), msg("assistant", "Blue.")]),
    ("empty_assistant", [msg("user", "Say nothing."), msg("assistant", "")]),
    ("empty_user", [msg("user", ""), msg("assistant", "You said nothing.")]),
    ("non_ascii", [msg("system", "Réponds en français."),
                   msg("user", "Café? 東京 🙂 naïve"),
                   msg("assistant", "Oui ☕ — 東京は素晴らしい 👍🏽")]),
    ("whitespace", [msg("system", "  padded system  \n"), msg("user", "\n  hello  \n"),
                    msg("assistant", "  \n answer with spaces \n\n"), msg("user", " next "),
                    msg("assistant", "\tdone\u00a0\u3000")]),
    ("ends_with_user", [msg("user", "First?"), msg("assistant", "Yes."),
                        msg("user", "And then?")]),
    ("three_turns", [msg("system", "Count."), msg("user", "one"), msg("assistant", "two"),
                     msg("user", "three"), msg("assistant", "four"), msg("user", "five"),
                     msg("assistant", "six\nseven")]),
    ("system_not_first", [msg("user", "Hi"), msg("system", "Be brief."), msg("user", "Again"),
                          msg("assistant", "Ok")]),
    ("two_systems", [msg("system", "Rule one."), msg("system", "Rule two."), msg("user", "Go"),
                     msg("assistant", "Went")]),
    ("consecutive_users", [msg("user", "a"), msg("user", "b"), msg("assistant", "c")]),
    ("assistant_first", [msg("assistant", "I start."), msg("user", "ok")]),
    ("think", [msg("user", "Why?"),
               msg("assistant", "<think>pondering\n</think>\n\nBecause.")]),
    ("only_system", [msg("system", "Just a system prompt.")]),
    ("only_user", [msg("user", "Hello?")]),
]

MARKER = "\ue000"


def training_texts():
    texts = list(corpus_lines(11))[:800]
    for _, messages in CASES:
        texts += [m["content"] for m in messages] * 3
    texts += ["Cutting Knowledge Date: December 2023", "Today Date: 26 Jul 2024",
              "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
              "You are a helpful assistant.", "system user assistant User: Assistant:"] * 5
    return texts


def make_tokenizer(kind, specials):
    if kind == "sentencepiece-v0.1":  # Mixtral-8x7B's layout
        assert specials == MISTRAL_SPECIALS
        return sentencepiece_kind(training_texts(), 200, [], LLAMA2_NORMALIZER, None)
    if kind == "sentencepiece-v0.3":  # Mistral-7B-Instruct-v0.3's current layout
        assert specials[:len(MISTRAL_SPECIALS)] == MISTRAL_SPECIALS
        return sentencepiece_kind(training_texts(), 200, specials[len(MISTRAL_SPECIALS):], None,
                                  metaspace("first", False))
    if kind == "deepseek":
        pre = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_PATTERNS]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        pattern = LLAMA3_PATTERN if kind == "llama3" else QWEN2_PATTERN
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer = Tokenizer(tokenizers.models.BPE())
    if kind == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(training_texts(), trainer=trainer)
    return tokenizer


def added_tokens_decoder(tokenizer):
    return {str(i): {"content": t.content, "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": True}
            for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}


def write_family(name, spec):
    template_file, _, kind, specials, config, _ = spec
    directory = os.path.join(OUT, name)
    os.makedirs(directory, exist_ok=True)
    tokenizer = make_tokenizer(kind, specials)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer.to_str(pretty=True) + "\n")
    with open(os.path.join(TEMPLATES, template_file), encoding="utf-8") as f:
        template = f.read()
    fields = dict(config, added_tokens_decoder=added_tokens_decoder(tokenizer),
                  chat_template=template)
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(fields.items())), f, ensure_ascii=False, indent=2)
        f.write("\n")
    return PreTrainedTokenizerFast.from_pretrained(directory)


def render(hf_tokenizer, messages, generation=False):
    return hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=generation)


def byte_offset(text, char_index):
    return len(text[:char_index].encode("utf-8"))


def trained_spans(hf_tokenizer, messages, text, eot):
    """[begin, end) byte spans of each assistant content and the end-of-turn token after it."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        marked = [dict(m) for m in messages]
        marked[i]["content"] = MARKER
        marked_text = render(hf_tokenizer, marked)
        assert marked_text.count(MARKER) == 1
        begin = marked_text.index(MARKER)
        suffix = marked_text[begin + 1:]
        assert text[:begin] == marked_text[:begin] and text.endswith(suffix)
        end = len(text) - len(suffix)
        assert text.startswith(eot, end), (text, end)
        spans.append([byte_offset(text, begin), byte_offset(text, end + len(eot))])
        # Where the prefix rendering is a prefix, the span lies in messages[i]'s addition.
        before = render(hf_tokenizer, messages[:i]) if i else ""
        upto = render(hf_tokenizer, messages[:i + 1])
        if upto.startswith(before) and text.startswith(upto):
            assert len(before) <= begin and end + len(eot) <= len(upto)
    return spans


def byte_decoder():
    """GPT-2's byte-to-character table, inverted: the character of each byte -> the byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
                 + list(range(0xAE, 0x100)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF = byte_decoder()


def trained_tokens(hf_tokenizer, ids, text, spans):
    """1 for each token whose bytes overlap a trained byte span, else 0 (the first token: 0).

    Each token's bytes: an added token's content, or its byte-level string mapped back through
    GPT-2's table; together they spell the text's UTF-8 bytes (asserted)."""
    added = {i: t.content for i, t in hf_tokenizer.added_tokens_decoder.items()}
    ends, total = [], 0
    for token_id, token in zip(ids, hf_tokenizer.convert_ids_to_tokens(ids)):
        total += (len(added[token_id].encode("utf-8")) if token_id in added
                  else len(bytes(BYTE_OF[c] for c in token)))
        ends.append(total)
    assert total == len(text.encode("utf-8")), "the tokens do not spell the text"
    flags = []
    for t, end in enumerate(ends):
        begin = ends[t - 1] if t else 0
        flags.append(int(t > 0 and any(begin < b_end and end > b_begin for b_begin, b_end in spans)))
    return flags


def trained_tokens_by_offsets(hf_tokenizer, ids, text, spans):
    """trained_tokens with each token's bytes from the library's offsets (SentencePiece)."""
    encoded = hf_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == ids
    flags = []
    for t, (begin, end) in enumerate(encoded["offset_mapping"]):
        begin, end = byte_offset(text, begin), byte_offset(text, end)
        overlaps = any(begin < b_end and end > b_begin for b_begin, b_end in spans)
        flags.append(int(t > 0 and overlaps))
    return flags


def family_results(name, spec, hf_tokenizer):
    eot = spec[5]
    mark = trained_tokens_by_offsets if spec[2].startswith("sentencepiece") else trained_tokens
    results = []
    for case_name, messages in CASES:
        row = {"family": name, "case": case_name}
        try:
            text = render(hf_tokenizer, messages)
        except jinja2.exceptions.TemplateError as error:
            results.append(dict(row, error=str(error)))
            continue
        ids = hf_tokenizer.apply_chat_template(messages)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
        spans = trained_spans(hf_tokenizer, messages, text, eot)
        row.update(text=text, prompt_text=render(hf_tokenizer, messages, generation=True),
                   ids=ids, trained=spans,
                   trained_tokens=mark(hf_tokenizer, ids, text, spans))
        results.append(row)
    return results


def main():
    results = []
    for name, spec in FAMILIES.items():
        results += family_results(name, spec, write_family(name, spec))
    document = {
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "families": {name: {"template": spec[1], "template_file": spec[0], "eot": spec[5]}
                     for name, spec in FAMILIES.items()},
        "sources": {file: {"source": source, "model": model}
                    for file, (source, model) in SOURCES.items()},
        "cases": [{"name": name, "messages": messages} for name, messages in CASES],
        "results": results,
    }
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(document, f, ensure_ascii=False, indent=1)
        f.write("\n")
    errors = sum("error" in r for r in results)
    print("transformers", transformers.__version__, "->", OUT, len(results), "results,",
          errors, "refused")


if __name__ == "__main__":
    main()
