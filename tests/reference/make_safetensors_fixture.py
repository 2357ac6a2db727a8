#!/usr/bin/python3
"""Writes safetensors_small.safetensors: a tiny file from an independent (Python) writer that
tests/core/safetensors_test.cpp reads back.

It covers every dtype dstrain reads (F32, F16, BF16, I32), a scalar, an empty tensor, odd
shapes, metadata, header keys in an order different from the data order, and an F32 tensor
at an unaligned offset (after a 10-byte F16 tensor). The F16 and BF16 tensors come with their
torch fp32 conversions ("*_as_f32") so the C++ reader's conversion is checked against torch.

Run from the repository root:  /usr/bin/python3 tests/reference/make_safetensors_fixture.py
"""
import os
import sys

import torch

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    f16_vector = torch.tensor([1.0, -2.5, 0.1, 65504.0, 6e-8], dtype=torch.float16)
    bf16_odd = torch.tensor([0.1, -3.14159, 1e30, -1e-30, 7.0, 255.5]).to(torch.bfloat16)
    tensors = [
        ("f16_vector", f16_vector),                                        # bytes [0, 10)
        ("f32_matrix", torch.tensor([[-1.0, -0.5, 0.0], [0.5, 1.0, 1.0 / 3.0]])),  # unaligned
        ("bf16_odd", bf16_odd.reshape(3, 1, 2)),
        ("i32_ids", torch.tensor([0, -1, 2147483647, 96], dtype=torch.int32)),
        ("scalar", torch.tensor(4.5)),
        ("empty", torch.zeros(0, 3)),
        ("f16_vector_as_f32", f16_vector.float()),
        ("bf16_odd_as_f32", bf16_odd.float().reshape(3, 1, 2)),
    ]
    header_order = sorted(name for name, _ in tensors)
    path = os.path.join(here, "safetensors_small.safetensors")
    write_safetensors(path, tensors, metadata={"format": "pt", "writer": "make_safetensors_fixture.py"},
                      header_order=header_order)
    back = read_safetensors(path)
    for name, tensor in tensors:
        assert torch.equal(back[name], tensor), name
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
