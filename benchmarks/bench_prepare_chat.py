#!/usr/bin/env python3
"""prepare --chat's throughput and how full the training rows of chat data are.

    python3 benchmarks/bench_prepare_chat.py BUILD/dstrain [--conversations 20000]
        [--tokenizer tests/reference/chat/llama3.1]

Writes a JSONL of conversations with a realistic mix of lengths (seeded): 1-6 user/assistant
turns (geometric, mean 2), a system prompt on 30%, message lengths in words log-normal with
medians of 25 (user) and 120 (assistant) words, as ShareGPT/UltraChat-style data is. Runs
`dstrain prepare --chat` on it (timed by the wall clock here, and dstrain's own line), then reads
the shards' loss masks back and prints, for T = 1024, 2048 and 4096:
  unpacked   one conversation per row (what dstrain trains today): the share of the rows'
             T positions that hold a conversation (filled) and a trained target (trained);
  packed     the same conversations packed greedily in file order into rows of T positions
             (a conversation of n tokens takes n - 1 positions, one too long for a row is cut
             to T): what --packing would reach.
  budget     one conversation per row under --batch-tokens 4T: micro-batches of whole
             conversations in file order, rows as wide as the longest rounded up to 8 (at most
             T), rows x width <= 4T (data/conversations.h, batch_conversations): the share of
             the micro-batches' positions filled.
The tokenizer is the small fixture one unless given: its vocabulary of a few hundred tokens
makes ~3x more tokens per word than a real one; the shares depend on the token counts, so give a
real model directory for numbers that mean that model.
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when "
         "model data train loss step token layer python code function value error result "
         "café naïve über 東京 データ 模型 训练 한국어 emoji 🙂").split()


def words(rng, median):
    n = max(1, int(rng.lognormvariate(0.0, 0.8) * median))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path, conversations, seed):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(conversations):
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": words(rng, 15)})
            turns = 1
            while turns < 6 and rng.random() < 0.5:
                turns += 1
            for _ in range(turns):
                messages.append({"role": "user", "content": words(rng, 25)})
                messages.append({"role": "assistant", "content": words(rng, 120)})
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")


def conversations_of(out_dir):
    """[(tokens, trained targets)] of every training conversation, from the .mask files."""
    result = []
    for name in sorted(os.listdir(out_dir)):
        if not (name.startswith("train_") and name.endswith(".mask")):
            continue
        with open(os.path.join(out_dir, name), "rb") as f:
            data = f.read()
        magic, version, count = struct.unpack("<3i", data[:12])
        assert magic == 20261127 and version == 1
        flags = data[1024:1024 + count]
        starts = [i for i, b in enumerate(flags) if b & 2] + [count]
        for a, b in zip(starts, starts[1:]):
            result.append((b - a, flags[a:b]))
    return result


def shares(conversations, T):
    rows_unpacked = len(conversations)
    filled = trained = 0
    packed_rows, used = 0, T  # start with a full row: the first conversation opens one
    for n, flags in conversations:
        positions = min(n - 1, T)
        filled += positions
        trained += sum(1 for b in flags[1:positions + 1] if b & 1)
        if used + positions > T:
            packed_rows += 1
            used = 0
        used += positions
    return (filled / (rows_unpacked * T), trained / (rows_unpacked * T),
            filled / (packed_rows * T), trained / (packed_rows * T),
            filled / budget_positions(conversations, T, 4 * T))


def budget_positions(conversations, T, budget):
    """The positions of the --batch-tokens micro-batches (rows x width, summed)."""
    total = rows = width = 0
    for n, _ in conversations:
        w = min(T, (min(n - 1, T) + 7) // 8 * 8)
        if rows > 0 and (rows + 1) * max(width, w) <= budget:
            rows, width = rows + 1, max(width, w)
            continue
        total += rows * width
        rows, width = 1, w
    return total + rows * width


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dstrain")
    parser.add_argument("--conversations", type=int, default=20000)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--tokenizer", default=os.path.join(root, "tests/reference/chat/llama3.1"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = os.path.join(tmp, "chat.jsonl")
        write_jsonl(jsonl, args.conversations, 1)
        out = os.path.join(tmp, "data")
        start = time.perf_counter()
        run = subprocess.run([args.dstrain, "prepare", "--chat", jsonl, "--tokenizer",
                              args.tokenizer, "--out", out, "--val-fraction", "0"],
                             capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if run.returncode != 0:
            sys.exit(run.stderr)
        record = json.load(open(os.path.join(out, "prepare.json")))
        conversations = conversations_of(out)
        tokens = sum(n for n, _ in conversations)
        mb = os.path.getsize(jsonl) / 1e6
        print(f"prepare --chat: {len(conversations)} conversations, {tokens} tokens "
              f"({record['trained_tokens']} trained), {mb:.1f} MB of JSONL, template "
              f"{record['chat_template']}, {seconds:.2f} s wall: "
              f"{len(conversations) / seconds:,.0f} conversations/s, {tokens / seconds:,.0f} tokens/s, "
              f"{mb / seconds:.1f} MB/s")
        for line in run.stdout.splitlines():
            if line.startswith("in "):
                print("dstrain says:", line)
        print()
        print("| T | unpacked filled | unpacked trained | packed filled | packed trained | "
              "budget 4T filled |")
        print("|---|---|---|---|---|---|")
        for T in (1024, 2048, 4096):
            u_fill, u_train, p_fill, p_train, b_fill = shares(conversations, T)
            print(f"| {T} | {100 * u_fill:.1f}% | {100 * u_train:.1f}% | {100 * p_fill:.1f}% | "
                  f"{100 * p_train:.1f}% | {100 * b_fill:.1f}% |")


if __name__ == "__main__":
    main()
