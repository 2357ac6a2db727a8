#!/usr/bin/env python3
"""Small Hugging Face BPE tokenizer.json files (byte-level and SentencePiece kinds) and the ids
the `tokenizers` library gives for test texts, for tests/data/bpe_tokenizer_test.cpp and
tests/cli (dstrain prepare).

Regenerate from the repository root (pip install tokenizers; 0.23.3 made the committed files):

    python3 tests/reference/make_tokenizer_fixtures.py

Writes tests/reference/tokenizers/:
  gpt2_kind.json          ByteLevel pre-tokenizer (GPT-2 regex), merges as [a, b] pairs,
                          <|endoftext|>
  gpt2_kind_legacy.json   the same tokenizer with merges as "a b" strings (older files)
  llama3_kind.json        Sequence[Split(Llama 3 regex, Isolated), ByteLevel(use_regex=False)],
                          ignore_merges, <|begin_of_text|>/<|end_of_text|>, and a
                          TemplateProcessing post-processor that adds <|begin_of_text|>
                          (dstrain, like encode(add_special_tokens=False), leaves it out)
  qwen2_kind.json         Qwen2's: an NFC normalizer, Split(Qwen2 regex: one digit a pre-token,
                          Isolated), ByteLevel(use_regex=False), <|endoftext|> <|im_start|>
                          <|im_end|>, a ByteLevel post-processor
  deepseek_kind.json      Sequence of several Splits (DeepSeek-LLM style, with `\\s+$`), then
                          ByteLevel(use_regex=False), <｜end▁of▁sentence｜>
  llama2_kind.json        the SentencePiece kind as Llama 2 / Mistral-7B-v0.1 / Mixtral-8x7B ship
                          it: normalizer Sequence[Prepend("▁"), Replace(" ", "▁")], no
                          pre-tokenizer, BPE with byte_fallback and fuse_unk over <unk> <s> </s>,
                          <0x00>..<0xFF>, "▁▁" and "▁▁▁▁" (merged first, as in Llama 2) and
                          pieces trained SentencePiece-style (words cut before each "▁", no
                          CJK or emoji: those go to byte tokens); decoder Sequence[Replace("▁",
                          " "), ByteFallback, Fuse, Strip(" ", 1, 0)]; a TemplateProcessing
                          post-processor adding <s>
  mistral_v3_kind.json    the newer layout (Mistral-7B-Instruct-v0.3's current file): no
                          normalizer, pre_tokenizer Metaspace("▁", prepend_scheme "first",
                          split false), and [INST] [/INST] [TOOL_CALLS] ... as special added
                          tokens (ids 3..9, before the byte tokens, as in v0.3)
  llama2_metaspace_kind.json  llama2_kind's model with no normalizer and Metaspace("▁",
                          prepend_scheme "always", split true) (some Llama 2 conversions)
  llama2_added_kind.json, mistral_v3_added_kind.json  llama2_kind and mistral_v3_kind with
                          two normalized, not special added tokens, as add_tokens() makes them
                          (<|im_start|>, and "lazy dog" with a space), for ADDED_TEXTS only
  cases.json              [{"tokenizer", "text", "ids", "decoded"}]: ids =
                          encode(text, add_special_tokens=False).ids and decoded =
                          decode(ids, skip_special_tokens=False), plus "prefix_decoded": the
                          decode of the ids without the last one (may cut a character) and
                          "normalized": the text the ids stand for (the NFC form for qwen2_kind;
                          for the SentencePiece kinds each token's text with "▁" as a space and
                          <0xNN> as its byte, so with the space of every prefix "▁"; a
                          normalized added token's normalized form). The
                          SentencePiece kinds also get SENTENCEPIECE_TEXTS and "offsets": each
                          token's [begin, end) in the text, the library's offsets in UTF-8 bytes
  corpus.txt              a text for `dstrain prepare --tokenizer`, and its ids per tokenizer in
                          prepare_ids.json (each with and without an end-of-text id at the end);
                          for the SentencePiece kinds in sentencepiece_corpus_ids.json
"""
import json
import os
import random
import re

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizers")

# GPT-2's pattern is built into ByteLevel(use_regex=True). Llama 3's (tiktoken cl100k style):
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen2.5's tokenizer.json): Llama 3's with one digit per pre-token.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-LLM's Splits, with its long letter class cut down to Latin-1 letters.
DEEPSEEK_PATTERNS = [r"[\r\n]", r"\s?[A-Za-zµÀ-ÖØ-öø-ÿ]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
                     r"\s+$", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}+"]
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"


def corpus_lines(seed):
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over lazy dog it's we're they've I'm you'll he'd "
             "don't THE QUICK IT'S WE'LL café naïve résumé Zürich straße señor "
             "東京 日本語 테스트 한국어 привет мир γειά emoji 🙂 👍🏽 data 2024 3.14159 "
             "1234567 ½ ٣ int main ( ) { return 0 ; } x+=1 a_b foo.bar").split()
    for _ in range(1500):
        n = rng.randint(3, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.2:
            line = "  " + line
        if rng.random() < 0.1:
            line += "   "
        yield line


TEXTS = [
    "",
    "Hello world",
    "Hello, world! It's a test: don't we're they've I'm you'll he'd.",
    "UPPER CASE IT'S WE'RE THEY'VE I'M YOU'LL HE'D 'S 'T 'Ll",
    "café naïve résumé Zürich straße señor",
    "東京は日本語で、테스트 한국어 привет мир γειά σου",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "numbers 1 12 123 1234 12345 1234567890 3.14159 ½ ٣٤٥ ３４",
    "spaces  two   three    four\tand\ttabs \t mixed",
    "trailing spaces   ",
    "   leading spaces",
    "line one\nline two\n\nline four\r\nwindows\r\n\n\n  indented\n",
    "punctuation!!! ... ??? --- ((( ))) {}[] <> #@$%^&*",
    "code: int main() { return x+=1; } // a_b foo.bar",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> spaced<|endoftext|><|endoftext|>end",
    "<|begin_of_text|>Hi<|end_of_text|> there <|end_of_text|>\n<|begin_of_text|>",
    "almost special <|endof text|> <|end_of_tex <|",
    DEEPSEEK_EOS + "deep" + DEEPSEEK_EOS + " seek " + DEEPSEEK_EOS,
    "unicode spaces\u00a0nbsp\u2003em\u3000ideographic\u0085nel\u2028ls x\u00a0",
    "long s 'ſ and Kelvin 'K",
    "a" * 300 + " " + "ab" * 100 + " " + " " * 50 + "z" + "\n" * 20 + "9" * 40,
    "mixed12abc34def 56.78 x1y2z3 ÷×",
    "\u00e9\u0301 combining e\u0301 and precomposed \u00e9",
    # Not in NFC: decomposed accents, Hangul jamo, the Angstrom and Ohm signs, reordered marks.
    "cafe\u0301 nai\u0308ve A\u030angstro\u0308m \u212b \u2126 \u1100\u1161\u11a8 "
    "a\u0323\u0302 a\u0302\u0323 \ufb01 \u00bd",
    "e\u0301<|endoftext|>\u0301x<|im_start|>u\u0308<|im_end|>",
]

# Texts for the SentencePiece kinds only (the byte-level kinds' cases stay as they were):
# leading, trailing and repeated spaces, the added tokens beside text and spaces, newlines
# before spaces, a literal "▁", tabs, byte tokens.
SENTENCEPIECE_TEXTS = [
    " ",
    "  ",
    "\n",
    "\t tab first",
    "<s>Hello</s>",
    "<s> Hello </s> ",
    "Hello<s>world</s>again",
    "  <s>  spaced  </s>  ",
    "</s></s><s>",
    "<unk> and <0x41> as text",
    "[INST] What is 2+2? [/INST] 4.</s>",
    "<s>[INST] Hi there![/INST] Hello! How can I help?</s>[INST] next[/INST]",
    "[INST]\n  hello  \n[/INST]   \n answer \n\n</s>",
    "x [INST]y[/INST] z[TOOL_CALLS]",
    "a\n b\n\n  c\n   d",
    "literal ▁ meta▁space ▁▁x ▁",
    "東京 🙂\n日本語👍🏽",
    "  indented\n    code = 1\n\tcode2\n",
    "ünïcödé  spaces\u00a0and\u3000others",
]

# For the SentencePiece kinds with normalized added tokens: matched in the normalized text,
# where Llama 2's layout has put a "▁" before them.
ADDED_TEXTS = ["<|im_start|>user", "a<|im_start|>b", " <|im_start|> x", "the lazy dog",
               "thelazy dog", "lazy dog<s>lazy dog", " lazy dog", "lazy  dog lazy dog"]

SP = "\u2581"  # "▁", SentencePiece's space
SP_SPECIALS = ["<unk>", "<s>", "</s>"]
MISTRAL_V3_CONTROLS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                       "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
LLAMA2_NORMALIZER = {"type": "Sequence", "normalizers": [
    {"type": "Prepend", "prepend": SP},
    {"type": "Replace", "pattern": {"String": " "}, "content": SP}]}
SENTENCEPIECE_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": SP}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def metaspace(prepend_scheme, split):
    return {"type": "Metaspace", "replacement": SP, "prepend_scheme": prepend_scheme,
            "split": split}


def sentencepiece_pieces(texts, vocab_size):
    """BPE pieces and merges trained the way SentencePiece makes them: words cut before each "▁"
    (a space), so a "▁" only starts a piece; characters past U+024F (CJK, Hangul, Cyrillic,
    emoji, ...) left out of the training text, so that they go to byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SP, prepend_scheme="always",
                                                       split=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    latin = ["".join(c for c in text if ord(c) < 0x250) for text in texts]
    tokenizer.train_from_iterator(latin, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    pieces = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    return pieces, model["merges"]


def sentencepiece_kind(texts, vocab_size, controls, normalizer, pre_tokenizer):
    """A tokenizer.json of the SentencePiece kind laid out as Llama 2's and Mistral's: the added
    tokens (<unk> <s> </s> and `controls`, special, not normalized) first, then the 256 byte
    tokens, "▁▁" and "▁▁▁▁" (merged first, as in Llama 2), then the trained pieces."""
    pieces, merges = sentencepiece_pieces(texts, vocab_size)
    specials = SP_SPECIALS + controls
    spaces = [SP * 2, SP * 4]
    tokens = (specials + ["<0x%02X>" % b for b in range(256)] + spaces
              + [p for p in pieces if p not in spaces])
    pair = (lambda a, b: a + " " + b) if merges and isinstance(merges[0], str) else (
        lambda a, b: [a, b])  # tokenizers < 0.20 writes "a b" strings
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, t in enumerate(specials)],
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "post_processor": None,
        "decoder": SENTENCEPIECE_DECODER,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": True,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": [pair(SP, SP), pair(SP * 2, SP * 2)] + merges}}
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tokenizer


def llama2_kind():
    return sentencepiece_kind(list(corpus_lines(5)), 460, [], LLAMA2_NORMALIZER, None)


def mistral_v3_kind():
    return sentencepiece_kind(list(corpus_lines(6)), 480, MISTRAL_V3_CONTROLS, None,
                              metaspace("first", False))


def with_layout(tokenizer, normalizer, pre_tokenizer):
    data = json.loads(tokenizer.to_str())
    data["normalizer"], data["pre_tokenizer"] = normalizer, pre_tokenizer
    return Tokenizer.from_str(json.dumps(data))


def with_normalized_added(tokenizer):
    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    tokenizer.add_tokens([AddedToken("<|im_start|>", normalized=True, special=False),
                          AddedToken("lazy dog", normalized=True, special=False)])
    return Tokenizer.from_str(tokenizer.to_str())


def spelled_text(tokenizer, ids):
    """What the ids spell token by token: an added token's content (a normalized one's
    normalized form with "▁" as a space), a <0xNN> token's byte, any other token with "▁" as a
    space."""
    added = tokenizer.get_added_tokens_decoder()
    out = b""
    for i in ids:
        token = tokenizer.id_to_token(i)
        if i in added and added[i].normalized and tokenizer.normalizer is not None:
            out += tokenizer.normalizer.normalize_str(added[i].content).replace(SP, " ").encode()
        elif i in added:
            out += added[i].content.encode("utf-8")
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", token):
            out += bytes([int(token[3:5], 16)])
        else:
            out += token.replace(SP, " ").encode("utf-8")
    return out.decode("utf-8")


def byte_offsets(text, offsets):
    """The library's character offsets as UTF-8 byte offsets."""
    def at(char_index):
        return len(text[:char_index].encode("utf-8"))
    return [[at(begin), at(end)] for begin, end in offsets]


def train(pre_tokenizer, special_tokens, vocab_size, seed):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(corpus_lines(seed)), trainer=trainer)
    return tokenizer


def gpt2_kind():
    return train(pre_tokenizers.ByteLevel(add_prefix_space=False), ["<|endoftext|>"], 600, 1)


def llama3_kind():
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer = train(pre, ["<|begin_of_text|>", "<|end_of_text|>"], 700, 2)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))])
    # Llama 3's model has ignore_merges: a word that is a whole token is taken as it is.
    data = json.loads(tokenizer.to_str())
    data["model"]["ignore_merges"] = True
    return Tokenizer.from_str(json.dumps(data))


def qwen2_kind():
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=680,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(list(corpus_lines(4)), trainer=trainer)
    return tokenizer


def deepseek_kind():
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False)
              for p in DEEPSEEK_PATTERNS]
    pre = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return train(pre, ["<｜begin▁of▁sentence｜>", DEEPSEEK_EOS], 650, 3)


def legacy_merges(tokenizer):
    """The tokenizer.json text with merges written as "a b" strings (tokenizers < 0.20 wrote
    them so; the library re-serializes them as pairs, so the text is kept as it is)."""
    data = json.loads(tokenizer.to_str())
    data["model"]["merges"] = [" ".join(pair) for pair in data["model"]["merges"]]
    return json.dumps(data, ensure_ascii=False, indent=2)


def normalized_text(tokenizer, text):
    """The text with the normalizer applied between the added tokens that are not normalized
    (the special ones here), as encode() does."""
    if tokenizer.normalizer is None:
        return text
    specials = sorted((t for t in tokenizer.get_added_tokens_decoder().values()),
                      key=lambda t: -len(t.content))
    out, i, start = [], 0, 0
    while i < len(text):
        token = next((t.content for t in specials if text.startswith(t.content, i)), None)
        if token is None:
            i += 1
            continue
        out += [tokenizer.normalizer.normalize_str(text[start:i]), token]
        i = start = i + len(token)
    out.append(tokenizer.normalizer.normalize_str(text[start:]))
    return "".join(out)


def write_json(name, value):
    with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    made = {"gpt2_kind": gpt2_kind(), "llama3_kind": llama3_kind(),
            "deepseek_kind": deepseek_kind(), "qwen2_kind": qwen2_kind()}
    texts = {name: tokenizer.to_str(pretty=True) for name, tokenizer in made.items()}
    texts["gpt2_kind_legacy"] = legacy_merges(made["gpt2_kind"])
    made["gpt2_kind_legacy"] = Tokenizer.from_str(texts["gpt2_kind_legacy"])
    sentencepiece = {"llama2_kind": llama2_kind(), "mistral_v3_kind": mistral_v3_kind()}
    sentencepiece["llama2_metaspace_kind"] = with_layout(sentencepiece["llama2_kind"], None,
                                                         metaspace("always", True))
    for name in ("llama2", "mistral_v3"):
        sentencepiece[name + "_added_kind"] = with_normalized_added(sentencepiece[name + "_kind"])
    for name, tokenizer in sentencepiece.items():
        texts[name] = tokenizer.to_str(pretty=True)
    for name, text in texts.items():
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)
            f.write("\n")
    cases = []
    for name, tokenizer in made.items():
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            cases.append({"tokenizer": name, "text": text, "ids": ids,
                          "normalized": normalized_text(tokenizer, text),
                          "decoded": tokenizer.decode(ids, skip_special_tokens=False),
                          "prefix_decoded": tokenizer.decode(ids[:-1],
                                                             skip_special_tokens=False)})
    for name, tokenizer in sentencepiece.items():
        for text in ADDED_TEXTS if "_added" in name else TEXTS + SENTENCEPIECE_TEXTS:
            encoding = tokenizer.encode(text, add_special_tokens=False)
            ids = encoding.ids
            cases.append({"tokenizer": name, "text": text, "ids": ids,
                          "normalized": spelled_text(tokenizer, ids),
                          "decoded": tokenizer.decode(ids, skip_special_tokens=False),
                          "prefix_decoded": tokenizer.decode(ids[:-1],
                                                             skip_special_tokens=False),
                          "offsets": byte_offsets(text, encoding.offsets)})
    # The byte fallback is exercised: CJK and emoji are byte tokens.
    assert sentencepiece["llama2_kind"].encode("東", add_special_tokens=False).tokens == [
        SP, "<0xE6>", "<0x9D>", "<0xB1>"]
    # The legacy file must give the same ids as the pair-merges one.
    for a, b in zip([c for c in cases if c["tokenizer"] == "gpt2_kind"],
                    [c for c in cases if c["tokenizer"] == "gpt2_kind_legacy"]):
        assert a["ids"] == b["ids"]
    # The post-processor adds <|begin_of_text|> only with add_special_tokens=True.
    llama = made["llama3_kind"]
    assert llama.encode("Hi").ids[0] == llama.token_to_id("<|begin_of_text|>")
    write_json("cases.json", {"tokenizers_version": tokenizers.__version__, "cases": cases})

    corpus = "\n".join(list(corpus_lines(7))[:200]) + "\nThe end.\n"
    with open(os.path.join(OUT, "corpus.txt"), "w", encoding="utf-8") as f:
        f.write(corpus)
    eot = {"gpt2_kind": "<|endoftext|>", "llama3_kind": "<|end_of_text|>",
           "deepseek_kind": DEEPSEEK_EOS, "qwen2_kind": "<|endoftext|>"}
    write_json("prepare_ids.json", {
        name: {"ids": made[name].encode(corpus, add_special_tokens=False).ids,
               "eot_id": made[name].token_to_id(eot[name])} for name in eot})
    write_json("sentencepiece_corpus_ids.json", {
        name: {"ids": tokenizer.encode(corpus, add_special_tokens=False).ids,
               "eot_id": tokenizer.token_to_id("</s>")}
        for name, tokenizer in sentencepiece.items() if "_added" not in name})
    print("tokenizers", tokenizers.__version__, "->", OUT, len(cases), "cases")


if __name__ == "__main__":
    main()
