#!/usr/bin/env python3
"""The soak's table (scripts/soak.sh): what the run did and whether its memory stayed flat.

Memory is flat when the resident set grows by less than one byte a step over the second half of
the run (a least-squares line through the samples, its rise over that half, per step run in it);
the first half holds the start-up (the allocator and the offloaded optimizer settle). A byte a
step is well below any per-step record (the first soak found the summary's list of losses
growing 8 bytes a step) and well above a page's noise over a multi-hour run.
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
    memory = []  # (seconds, bytes, steps: counted, or estimated at the run's mean rate)
    with open(os.path.join(directory, "memory.tsv")) as tsv:
        next(tsv)
        for line in tsv:
            fields = line.split()
            steps_then = float(fields[2]) if len(fields) > 2 else None
            memory.append((float(fields[0]), float(fields[1]) * 1024, steps_then))
    total_steps = steps[-1]["step"] if steps else 0
    end = memory[-1][0] if memory else 0.0
    memory = [(t, m, n if n is not None else (total_steps * t / end if end else 0.0))
              for t, m, n in memory]
    with open(os.path.join(directory, "stdout.txt")) as out:
        text = out.read()
    saved = text.count("saved checkpoint")
    mirrored = text.count("; mirrored to ")
    not_mirrored = text.count("NOT mirrored")
    damaged = text.count("reads back damaged")
    second_half = memory[len(memory) // 2:]
    rise = line_rise([(t, m) for t, m, _ in second_half]) if len(second_half) >= 2 else 0.0
    steps_in_half = second_half[-1][2] - second_half[0][2] if len(second_half) >= 2 else 0.0
    per_step = rise / steps_in_half if steps_in_half > 0 else 0.0
    flat = steps_in_half > 0 and per_step < 1.0
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
        ("RSS: at 10%, 50%, end", ", ".join("%.1f MiB" % (memory[int(f * (len(memory) - 1))][1] / 2**20)
                                            for f in (0.1, 0.5, 1.0)) if memory else "-"),
        ("RSS peak", "%.1f MiB" % (max(m for _, m, _ in memory) / 2**20) if memory else "-"),
        ("RSS rise over the second half", "%+.2f MiB over %.0f steps: %.2f bytes a step, %s" % (
            rise / 2**20, steps_in_half, per_step, "flat" if flat else "GROWING")),
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
