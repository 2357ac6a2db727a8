// Hugging Face BPE tokenizers, read from a `tokenizer.json`, of two families:
//  - byte-level: the GPT-2 kind (pre_tokenizer ByteLevel with its regex) and the Llama-3 /
//    Qwen2 / DeepSeek kind (pre_tokenizer Sequence[Split(Regex, Isolated)..., ByteLevel(use_regex
//    false)]);
//  - SentencePiece (Llama 2, Mistral-7B v0.1/v0.3, Mixtral): spaces written "▁", the model with
//    byte_fallback (a character outside the vocabulary becomes the <0xNN> tokens of its UTF-8
//    bytes), in two layouts: normalizer Sequence[Prepend("▁"), Replace(" ", "▁")] and no
//    pre_tokenizer (Llama 2's, Mistral v0.1's), or no normalizer and pre_tokenizer
//    Metaspace("▁", prepend_scheme first|always|never, split true|false) (Mistral v0.3's current
//    file, newer Llama 2 conversions).
//
// encode(text) gives the ids of the `tokenizers` library's
// `Tokenizer.encode(text, add_special_tokens=False).ids`: the added tokens that are not
// "normalized" (the special ones) are cut out of the text as whole strings first (leftmost,
// longest at a position); each piece between them is normalized, the normalized added tokens
// are cut out of it (matching their normalized form), and the rest is pre-tokenized and merged
// by BPE rank. The post_processor (Llama 3's <|begin_of_text|>, Llama 2's <s>) is not applied.
//  - byte-level: the pieces are split by the pre-tokenizer's regexes and mapped to GPT-2's
//    byte-to-character alphabet before BPE.
//  - SentencePiece: Prepend puts a "▁" before every non-empty piece between the added tokens,
//    even one that starts with a space (" Hi" -> "▁▁Hi"; "a<s>b" -> "▁a", <s>, "▁b"), and the
//    whole normalized piece is one BPE word. Metaspace writes the spaces "▁" and puts a "▁"
//    before a piece that does not start with one: with "always" before every piece, with
//    "first" only before a piece at the start of the text (not after an added token), with
//    "never" before none; split true cuts the words before each "▁". BPE starts from one symbol
//    per character of the vocabulary, else per byte (<0xNN>). A word is merged run by run
//    between the symbols that no merge involves (<0x0A> in the real files), which gives the
//    same ids as merging it whole, in memory for a line rather than for a whole file.
//
// Supported: normalizer null or NFC (Qwen2's; the text between the added tokens that are not
// "normalized" is put in NFC before the rest is cut out, as the library does) for the
// byte-level kinds, the two layouts above for SentencePiece (replacement "▁" only, and the
// decoder Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", n, m)?]); model BPE
// (merges as "a b" strings or [a, b] pairs, ignore_merges, unk_token and fuse_unk;
// byte_fallback for SentencePiece only, and with all 256 <0xNN> tokens; no dropout, no
// continuing_subword_prefix, no end_of_word_suffix); added tokens without lstrip, rstrip or
// single_word. Anything else (a Metaspace decoder, a Metaspace after a normalizer, a
// SentencePiece model without byte_fallback, ...) is refused when the file is read, in one
// sentence naming the file and what is unsupported.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dstrain {

class BpeTokenizer {
 public:
  // Reads a tokenizer.json. Throws UserError, naming the file, when it is missing, not JSON,
  // lacks model.vocab or model.merges, has a merge naming a token (or a merged token) that is
  // not in the vocabulary, an id outside [0, 2^24) or two vocabulary tokens with one id, a
  // regex that does not compile, or a normalizer, pre-tokenizer, model or option this class
  // does not implement.
  static BpeTokenizer from_file(const std::string& path);
  // The same from the JSON text; `name` appears in error messages.
  static BpeTokenizer from_json(std::string_view json_text, const std::string& name);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  // One more than the largest id of the vocabulary and the added tokens: the embedding rows a
  // model needs.
  int64_t vocab_size() const;

  // The ids of `text`. Throws UserError when text is not valid UTF-8 (naming the byte offset).
  // Not thread-safe: it fills a cache of the ids of each pre-token (use one tokenizer per
  // thread).
  std::vector<int32_t> encode(std::string_view text);

  // A token's place in the text it was encoded from: bytes [begin, end).
  struct TokenSpan {
    size_t begin = 0;
    size_t end = 0;
    bool operator==(const TokenSpan&) const = default;
  };
  // encode(text), and in `spans` (replaced) each id's bytes of the text, as the library's
  // offsets give them (in bytes). Both ends rise with the ids, and the last ends at the end of
  // the text wherever the tokens spell its last bytes. Byte-level kinds: an added token covers
  // its match; in each word of the pre-tokenizer the tokens' bytes one after the other (a
  // prefix space covering none); under Qwen2's NFC normalizer, a token inside a character
  // sequence that NFC changes covers that whole sequence of the text. A vocabulary that lacks a
  // byte's character (no real file does: they hold all 256) drops that byte or spells it
  // unk_token, as the library does; the spans inside that word are then those of the tokens'
  // bytes, held inside the word. SentencePiece: a "▁" standing for a space covers that
  // space, a prefix "▁" the first character of the piece after it (so a token "▁" alone
  // covers the same bytes as the token after it), and every byte token of a character the
  // whole character.
  std::vector<int32_t> encode(std::string_view text, std::vector<TokenSpan>& spans);

  // The bytes the ids stand for, token after token: added tokens as their text; byte-level
  // vocabulary tokens through the inverse of the byte-to-character table (a token with a
  // character outside the table as its own UTF-8); SentencePiece vocabulary tokens with each
  // "▁" as a space and <0xNN> as its byte (and a normalized added token as its normalized
  // form so), so decode_bytes(encode(text)) is the text with one more space before each piece
  // that got a prefix "▁" (and any "▁" of the text a space). Throws UserError on an id with no
  // token.
  std::string decode_bytes(std::span<const int32_t> ids) const;
  // The text of the ids, the way the library's decode(ids, skip_special_tokens=False) gives
  // it. Byte-level kinds: decode_bytes with each maximal ill-formed UTF-8 subsequence as
  // U+FFFD (a cut multi-byte character at the end of a sample, say). SentencePiece, the
  // file's decoder: every token (added ones too; a normalized added token in its normalized
  // form, as tokenizers 0.23 does) with "▁" as a space, each run of byte tokens as its bytes
  // if they are valid UTF-8, else one U+FFFD per byte token; joined; then Strip removes up to
  // n leading (m trailing) spaces of the whole text only: "▁Hello" gives "Hello", <s> "▁Hello"
  // gives "<s> Hello". An id with no token (a model's vocabulary padded past the tokenizer's)
  // shows as "<ID>" instead of an error.
  std::string decode(std::span<const int32_t> ids) const;

  // The id of a token (vocabulary or added), if there is one.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The end-of-text id for `prepare --eot`: the first added token among <|endoftext|>
  // (GPT-2, Qwen2), <|end_of_text|> (Llama 3), <｜end▁of▁sentence｜> (DeepSeek) and </s>
  // (Llama 2, Mistral: their eos); none when the file has none of them.
  std::optional<int32_t> end_of_text_id() const;

  // The length of the longest prefix of `text` that can be encoded on its own with the same
  // ids as within the whole text, for any text that may follow. Lets prepare encode a large
  // file block by block.
  //  - byte-level: up to the last "\n" that has a printable non-space ASCII character on both
  //    sides (no pre-tokenizer pattern of the supported kinds puts such a newline inside a
  //    pre-token with what follows it); 0 when an added token contains a newline.
  //  - SentencePiece: up to (not including) the last space where the block after the cut gets
  //    no prefix "▁" and no merge reaches across: with Metaspace (or Replace alone) a piece
  //    starting with a space gets no prefix; the BPE words end there when Metaspace splits
  //    them, or when the character before the space is an ASCII one whose symbol no merge
  //    involves (Mistral's "\n", its <0x0A>: "line\n  indented"). 0 with the Prepend normalizer
  //    (Llama 2, Mistral v0.1: the block after any cut would get a "▁" the whole text has not;
  //    prepare then encodes the file whole, its BPE run line by line), or when an added token
  //    holds a space.
  //  - 0 when there is no such place.
  size_t safe_prefix_length(std::string_view text) const;

  struct Impl;  // the tables; defined in bpe_tokenizer_impl.h (its readers need the name)

 private:
  explicit BpeTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// GPT-2's byte-to-character table (`bytes_to_unicode`): the printable bytes '!'..'~',
// 0xA1..0xAC and 0xAE..0xFF stand for themselves; the other 68 bytes, in increasing order,
// for U+0100, U+0101, ... Returns the character's code point.
char32_t byte_to_unicode(unsigned char byte);

}  // namespace dstrain
