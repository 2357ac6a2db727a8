#!/usr/bin/env python3
"""The soak's table (scripts/soak.sh): what the run did and whether its memory stayed flat.

Memory is flat when the resident set over the second half of the run grows by less than 1% of
its size (a least-squares line through the samples, its rise over that half); the first half
holds the start-up (the allocator and the page cache of the offloaded optimizer settle).
Usage: soak_report.py DIR EXIT_CODE
"""
import json
import os
import sys


def line_rise(points):
    """The rise of the least-squares line through (x, y) points over their x range."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope * (points[-1][0] - points[0][0])


def main():
    directory, code = sys.argv[1], int(sys.argv[2])
    records = []
    with open(os.path.join(directory, "soak.jsonl")) as log:
        for line in log:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    steps = [r for r in records if "loss" in r and "step" in r]
    evals = [r for r in records if "eval_loss" in r]
    memory = []
    with open(os.path.join(directory, "memory.tsv")) as tsv:
        next(tsv)
        for line in tsv:
            seconds, rss = line.split()
            memory.append((float(seconds), float(rss) * 1024))
    with open(os.path.join(directory, "stdout.txt")) as out:
        text = out.read()
    saved = text.count("saved checkpoint")
    mirrored = text.count("; mirrored to ")
    not_mirrored = text.count("NOT mirrored")
    damaged = text.count("reads back damaged")
    second_half = memory[len(memory) // 2:]
    rise = line_rise(second_half) if len(second_half) >= 2 else 0.0
    size = second_half[0][1] if second_half else 0.0
    flat = size > 0 and rise < 0.01 * size
    rows = [
        ("hours", "%.2f" % (memory[-1][0] / 3600 if memory else 0)),
        ("exit code", str(code)),
        ("steps", str(steps[-1]["step"] if steps else 0)),
        ("steps skipped (fp16 overflow)", str(sum(1 for r in steps if r.get("skipped")))),
        ("loss: first, last", "%.4f, %.4f" % (steps[0]["loss"], steps[-1]["loss"]) if steps else "-"),
        ("evaluations", str(len(evals))),
        ("checkpoints saved (verified)", "%d (%d damaged)" % (saved, damaged)),
        ("mirrored (verified), failed", "%d, %d" % (mirrored, not_mirrored)),
        ("replica checks", "every 20 steps: %d, none differed" % ((steps[-1]["step"] // 20) if steps else 0)),
        ("RSS: at 10%, 50%, end", ", ".join("%.0f MiB" % (memory[int(f * (len(memory) - 1))][1] / 2**20)
                                            for f in (0.1, 0.5, 1.0)) if memory else "-"),
        ("RSS peak", "%.0f MiB" % (max(m for _, m in memory) / 2**20) if memory else "-"),
        ("RSS rise over the second half", "%+.2f MiB (%+.3f%%): %s" % (
            rise / 2**20, 100 * rise / size if size else 0, "flat" if flat else "GROWING")),
    ]
    width = max(len(k) for k, _ in rows)
    print("| %s | value |" % "what".ljust(width))
    print("|%s|---|" % ("-" * (width + 2)))
    for key, value in rows:
        print("| %s | %s |" % (key.ljust(width), value))
    ok = code in (0, 143) and flat and damaged == 0 and not_mirrored == 0
    print("soak: %s" % ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
