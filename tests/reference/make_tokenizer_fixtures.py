#!/usr/bin/env python3
"""Small Hugging Face byte-level BPE tokenizer.json files and the ids the `tokenizers` library
gives for test texts, for tests/data/bpe_tokenizer_test.cpp and tests/cli (dstrain prepare).

Regenerate from the repository root (pip install tokenizers):

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
  cases.json              [{"tokenizer", "text", "ids", "decoded"}]: ids =
                          encode(text, add_special_tokens=False).ids and decoded =
                          decode(ids, skip_special_tokens=False), plus "prefix_decoded": the
                          decode of the ids without the last one (may cut a character) and
                          "normalized": the text the ids stand for (the NFC form for qwen2_kind)
  corpus.txt              a text for `dstrain prepare --tokenizer`, and its ids per tokenizer in
                          prepare_ids.json (each with and without an end-of-text id at the end)
"""
import json
import os
import random

import tokenizers
from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

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
    print("tokenizers", tokenizers.__version__, "->", OUT, len(cases), "cases")


if __name__ == "__main__":
    main()
