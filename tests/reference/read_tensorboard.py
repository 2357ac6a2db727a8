#!/usr/bin/python3
"""Reads a directory of TensorBoard event files with tensorboard's own reader and checks it.

  read_tensorboard.py DIR             print every scalar tag: its points, first and last
  read_tensorboard.py DIR LOG.jsonl   also compare with what dstrain's JSONL log says: every
                                      scalar the log implies must be in DIR, at its step, with
                                      its value as a float32, and DIR must hold nothing else
  read_tensorboard.py --fixture       print the hex bytes of the events that
                                      tests/core/tensorboard_test.cpp compares with its own

Exit 0: equal (or nothing to compare); 1: a difference (each printed); 2: bad arguments;
77 (skipped): the tensorboard package is not importable (PyPI tensorboard; 2.21 was used).

DIR is read with tensorboard.backend.event_processing.event_accumulator.EventAccumulator
(every point kept), which reads all event files of the run in name order and, at a SessionLog
START event, drops the points of every tag at that step and later.

The tags a log implies are derived here independently of the C++ code (src/core/tensorboard.h
states the same scheme):
  - a record with "step": every other field at that step; nested objects join keys with "/";
    array elements take their index, or "layer_<n>" / "stage_<n>" for an object with an
    integer "layer" / "stage" field (that field then left out);
  - "type": "summary" (no step): the same under "summary/" at its "steps";
  - "type": "config", or no type: nothing;
  - any other type ("memory", "data"): the same under "<type>/" at the step the run started
    from, taken as one less than the step of the next record with a step (the last step seen
    when none follows);
  - booleans are 0/1, strings are left out; a null (how JSON writes NaN and infinities) stands
    for a non-finite value, or for nothing.
A "memory" record starts a run (a fresh or a resumed one): with S the step of the next record
with a step, the points at S and later of every earlier run are expected to be gone (dstrain
opens each run's event file with a SessionLog START at S).
"""
import io
import json
import math
import os
import struct
import sys

SKIP = 77


def as_float32(value):
    """The float32 nearest `value`, as a Python float (what simple_value holds)."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


# ---- the tag scheme ----------------------------------------------------------------------

def element_name(element):
    if isinstance(element, dict):
        for field in ("layer", "stage"):
            key = element.get(field)
            if isinstance(key, int) and not isinstance(key, bool):
                return field, "%s_%d" % (field, key)
    return None


def leaves(value, tag, out, skipped=None):
    """Appends (tag, value or None) for every number, boolean and null under `value`."""
    if isinstance(value, dict):
        for key, member in value.items():
            if key != skipped:
                leaves(member, key if not tag else tag + "/" + key, out)
    elif isinstance(value, list):
        for index, element in enumerate(value):
            named = element_name(element)
            if named:
                leaves(element, tag + "/" + named[1], out, skipped=named[0])
            else:
                leaves(element, "%s/%d" % (tag, index), out)
    elif isinstance(value, bool):
        out.append((tag, 1.0 if value else 0.0))
    elif isinstance(value, (int, float)):
        out.append((tag, as_float32(float(value))))
    elif value is None:
        out.append((tag, None))


def is_step(value):
    return isinstance(value, int) and not isinstance(value, bool)


def expected_points(records):
    """tag -> [(step, value or None)] in the order the log implies them."""
    points = {}
    last_step = 0
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            continue
        if is_step(record.get("step")):
            last_step = record["step"]
            found = []
            leaves(record, "", found, skipped="step")
            step = last_step
        else:
            kind = record.get("type")
            if not isinstance(kind, str) or kind == "config":
                continue
            next_step = next((r["step"] for r in records[index + 1:]
                              if isinstance(r, dict) and is_step(r.get("step"))), None)
            if kind == "memory" and next_step is not None:
                for tag in points:  # the restart: a SessionLog START at next_step
                    points[tag] = [p for p in points[tag] if p[0] < next_step]
            if kind == "summary" and is_step(record.get("steps")):
                step = record["steps"]
            else:
                step = next_step - 1 if next_step is not None else last_step
            found = []
            leaves(record, kind, found)
        for tag, value in found:
            points.setdefault(tag, []).append((step, value))
    return points


# ---- reading and comparing ---------------------------------------------------------------

def read_scalars(directory):
    from tensorboard.backend.event_processing import event_accumulator
    accumulator = event_accumulator.EventAccumulator(
        directory, size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def same_value(expected, actual):
    if expected is None:
        return not math.isfinite(actual)
    return expected == actual or (math.isnan(expected) and math.isnan(actual))


def compare_tag(tag, expected, actual):
    """The differences of one tag's points (a None expected value may be absent)."""
    problems = []
    i = 0
    for step, value in expected:
        if i < len(actual) and actual[i][0] == step and same_value(value, actual[i][1]):
            i += 1
        elif value is not None:
            found = actual[i] if i < len(actual) else "nothing"
            problems.append("%s: expected step %d value %r, found %s" % (tag, step, value, found))
            if i < len(actual) and actual[i][0] == step:
                i += 1
    for extra in actual[i:]:
        problems.append("%s: unexpected point %s" % (tag, extra))
    return problems


def compare(expected, actual):
    problems = []
    for tag in sorted(set(expected) | set(actual)):
        problems += compare_tag(tag, expected.get(tag, []), actual.get(tag, []))
    return problems


def print_scalars(scalars):
    points = sum(len(p) for p in scalars.values())
    print("%d scalar tags, %d points" % (len(scalars), points))
    for tag in sorted(scalars):
        p = scalars[tag]
        print("  %-48s %5d points  first step %d: %.6g  last step %d: %.6g"
              % (tag, len(p), p[0][0], p[0][1], p[-1][0], p[-1][1]))


# ---- the fixture of tests/core/tensorboard_test.cpp ---------------------------------------

def fixture_events():
    """The events the C++ test encodes too, made with tensorboard's protos."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    version = event_pb2.Event(wall_time=1700000000.25, file_version="brain.Event:2")
    values = [("loss", 2.5), ("time/compute_s", 0.125), ("zero", 0.0), ("negative", -1e-3),
              ("t" * 130, 65504.0)]
    scalars = event_pb2.Event(wall_time=1700000001.5, step=300, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values]))
    start = event_pb2.Event(wall_time=1700000002.0, step=101,
                            session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START))
    negative = event_pb2.Event(step=-2, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="lr", simple_value=3e-4)]))
    return [("version", version), ("scalars", scalars), ("start", start), ("negative_step", negative)]


def print_fixture():
    from tensorboard.summary.writer.record_writer import RecordWriter
    for name, event in fixture_events():
        data = event.SerializeToString()
        stream = io.BytesIO()
        RecordWriter(stream).write(data)
        print("%s event:  %s" % (name, data.hex()))
        print("%s record: %s" % (name, stream.getvalue().hex()))


def main(argv):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print("skipped: the tensorboard package is not importable", file=sys.stderr)
        return SKIP
    if argv == ["--fixture"]:
        print_fixture()
        return 0
    if len(argv) not in (1, 2) or not os.path.isdir(argv[0]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    actual = read_scalars(argv[0])
    print_scalars(actual)
    if len(argv) == 1:
        return 0
    with open(argv[1]) as log:
        records = [json.loads(line) for line in log if line.strip()]
    problems = compare(expected_points(records), actual)
    for problem in problems:
        print("difference: " + problem)
    print("%s: %d differences from %s" % ("FAIL" if problems else "OK", len(problems), argv[1]))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
