"""A minimal safetensors writer and reader in plain Python, independent of dstrain's C++ code
and of the `safetensors` package (which this machine does not need).

Format: 8-byte little-endian header length N, N bytes of JSON header padded with spaces to a
multiple of 8, then the data buffer; each tensor's "data_offsets" [begin, end) are relative
to the start of the data buffer.
"""
import json
import struct

import torch

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
}
_NUMPY_TYPES = {torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4"}
_TORCH_TYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def tensor_bytes(tensor):
    """Row-major little-endian bytes of a CPU tensor."""
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: take the raw 16-bit patterns
        return tensor.view(torch.int16).numpy().astype("<i2").tobytes()
    return tensor.numpy().astype(_NUMPY_TYPES[tensor.dtype]).tobytes()


def write_safetensors(path, tensors, metadata=None, header_order=None):
    """Writes [(name, tensor), ...] with the data in list order.

    header_order: the order of the keys in the JSON header (default: list order); a
    different order checks that readers go by data_offsets, not by key order.
    """
    entries = {}
    chunks = []
    offset = 0
    for name, tensor in tensors:
        data = tensor_bytes(tensor)
        entries[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name in header_order or [name for name, _ in tensors]:
        header[name] = entries[name]
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for data in chunks:
            out.write(data)


def read_safetensors(path):
    """{name: tensor} of a file written by write_safetensors (used for self-checks)."""
    with open(path, "rb") as source:
        blob = source.read()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    header.pop("__metadata__", None)
    data = blob[8 + length :]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = _TORCH_TYPES[entry["dtype"]]
        raw = bytearray(data[begin:end])
        if dtype == torch.bfloat16:
            flat = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16) if raw else \
                torch.zeros(0, dtype=dtype)
        else:
            flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        tensors[name] = flat.reshape(entry["shape"]).clone()
    return tensors
