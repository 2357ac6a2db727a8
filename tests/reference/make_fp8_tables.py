#!/usr/bin/env python3
"""FP8 conversion tables from ml_dtypes (JAX's float8 types), for tests/core/fp8_test.cpp.

ml_dtypes implements the OCP formats float8_e4m3fn and float8_e5m2 in its non-saturating mode
(E4M3 overflows to NaN, E5M2 to infinity), rounding fp32 to nearest even. For each format:
  decode: the fp32 bits of every FP8 byte (NaNs as "nan" with their sign);
  encode: (fp32 bits, FP8 byte) for every FP8 value, every midpoint between neighbours and the
          fp32 values one ulp either side of it, the ranges past the largest finite value and
          below the smallest subnormal, and 4000 random fp32 values of both signs, log-uniform
          over the format's range and beyond. A NaN result is written as its sign and "nan".
Usage: pip install ml_dtypes; python3 make_fp8_tables.py > fp8_tables.json
"""
import json
import sys

import ml_dtypes
import numpy as np

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def bits_of(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def encoded(fp8_bytes, fp8_type):
    out = []
    for byte in fp8_bytes:
        value = np.array([byte], dtype=np.uint8).view(fp8_type)[0]
        out.append(("-nan" if byte & 0x80 else "nan") if np.isnan(np.float32(value)) else int(byte))
    return out


def table(name, fp8_type):
    all_bytes = np.arange(256, dtype=np.uint8)
    decoded = all_bytes.view(fp8_type).astype(np.float32)
    decode = [("-nan" if b & 0x80 else "nan") if np.isnan(v) else "%08x" % int(bits_of([v])[0])
              for b, v in zip(all_bytes, decoded)]
    finite = np.sort(np.unique(decoded[np.isfinite(decoded) & (decoded >= 0)]))
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # exact in fp32
    mids = mids.astype(np.float32)
    inputs = [finite, mids, np.nextafter(mids, np.float32(np.inf)),
              np.nextafter(mids, np.float32(0))]
    largest = float(finite[-1])
    ulp = float(finite[-1] - finite[-2])
    edges = np.array([largest + ulp / 2, largest + ulp / 4, largest + ulp * 0.75, largest * 2,
                      largest * 1e3, 3e38, np.inf, float(finite[1]) / 2, float(finite[1]) / 4,
                      float(finite[1]) * 0.75, 1e-30, 1e-45, 0.0], dtype=np.float32)
    inputs.append(np.nextafter(edges, np.float32(np.inf)))
    inputs.append(np.nextafter(edges, np.float32(0)))
    inputs.append(edges)
    rng = np.random.default_rng(20261127)
    low, high = np.log2(float(finite[1])) - 3, np.log2(largest) + 3
    inputs.append(np.exp2(rng.uniform(low, high, 4000)).astype(np.float32))
    values = np.concatenate(inputs).astype(np.float32)
    values = np.concatenate([values, -values, np.array([np.nan, -np.nan], dtype=np.float32)])
    fp8 = values.astype(fp8_type).view(np.uint8)
    encode = [["%08x" % int(b), e] for b, e in zip(bits_of(values), encoded(fp8, fp8_type))]
    return {"decode": decode, "encode": encode}


def main():
    out = {"ml_dtypes": ml_dtypes.__version__}
    for name, fp8_type in FORMATS.items():
        out[name] = table(name, fp8_type)
    json.dump(out, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
