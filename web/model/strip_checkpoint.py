#!/usr/bin/env python3
"""Writes a training checkpoint of `attn train` without its optimizer state
(the adamw.* / sgd.* tensors): the parameters and the metadata, which is all
a forward pass needs. Usage: strip_checkpoint.py IN.safetensors OUT.safetensors"""
import json
import struct
import sys


def main(src, dst):
    data = open(src, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out_header, chunks, offset = {}, [], 0
    for name, info in header.items():
        if name == "__metadata__":
            out_header[name] = info
            continue
        if name.startswith(("adamw.", "sgd.")):
            continue
        begin, end = info["data_offsets"]
        chunks.append(body[begin:end])
        out_header[name] = dict(info, data_offsets=[offset, offset + end - begin])
        offset += end - begin
    text = json.dumps(out_header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
