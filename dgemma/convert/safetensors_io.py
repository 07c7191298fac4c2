"""Minimal, strict safetensors reader/writer (no pickle, one tensor in memory at a time).

Why not `safetensors.safe_open(framework="numpy")`: numpy has no bfloat16 / float8 dtypes, and the torch/flax
frameworks would pull a second runtime or a device copy in. The format is simple (u64 header length, JSON header,
raw little-endian bytes), so this module parses it directly with `ml_dtypes` and reads each tensor's byte range with
`os.pread`. That gives: bf16 and fp8 support, exact per-tensor reads (no mmap page cache counted against RSS),
and validation that names the file and key (truncated file, overlapping or out-of-range offsets, unknown dtype).
Files are cross-checked against the `safetensors` library in the tests.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from dgemma.convert.hf_config import CheckpointError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """Header-validated view of one .safetensors file; `read(key)` returns a fresh numpy array."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: file not found") from None
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{self.path}: corrupt or truncated safetensors header (header length {n}, "
                                      f"file size {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        data_len = size - self.data_start
        spans = []
        for key, entry in header.items():
            dtype = DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{self.path}: tensor {key!r} has unsupported dtype {entry.get('dtype')!r}")
            shape = tuple(int(s) for s in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
            expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - start != expected:
                raise CheckpointError(f"{self.path}: tensor {key!r} byte range {end - start} does not match shape "
                                      f"{list(shape)} x {entry['dtype']} ({expected} bytes)")
            if end > data_len:
                raise CheckpointError(f"{self.path}: truncated file: tensor {key!r} needs bytes up to {end} but "
                                      f"the data section has {data_len}")
            spans.append((start, end, key))
            self.entries[key] = (dtype, shape, start, end)
        spans.sort()
        for (s0, e0, k0), (s1, _, k1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise CheckpointError(f"{self.path}: tensors {k0!r} and {k1!r} overlap (corrupt header)")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def dtype(self, key: str) -> np.dtype:
        return self.entries[key][0]

    def read(self, key: str) -> np.ndarray:
        dtype, shape, start, end = self.entries[key]
        buf = bytearray(end - start)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            view, off = memoryview(buf), 0
            while off < len(buf):
                got = os.preadv(fd, [view[off:]], self.data_start + start + off)
                if got <= 0:
                    raise CheckpointError(f"{self.path}: truncated while reading tensor {key!r}")
                off += got
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=dtype).reshape(shape)


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    """Write tensors (in the given order) to `path`. The caller handles atomicity (temp dir + rename)."""
    header, offset = {}, 0
    for key, a in tensors.items():
        a = np.asarray(a)
        name = DTYPE_NAMES.get(a.dtype)
        if name is None:
            raise ValueError(f"tensor {key!r}: dtype {a.dtype} cannot be written to safetensors")
        header[key] = {"dtype": name, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def checkpoint_files(directory: str | os.PathLike) -> Mapping[str, list[str] | None]:
    """Map each safetensors file of a checkpoint directory to the keys the index says it holds (None without an
    index).

    Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) layouts are supported. Pickle
    checkpoints are refused: nothing is ever unpickled.
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: not a checkpoint directory")
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: invalid index file ({e!r})") from None
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            files.setdefault(fname, []).append(key)
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise CheckpointError(f"{index}: shard file(s) {missing} listed in the index are missing from {d}")
        return files
    singles = sorted(p.name for p in d.glob("*.safetensors"))
    if singles:
        return {name: None for name in singles}
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{d}: only pickle checkpoint files found ({pickles}); dgemma never unpickles "
                              "(arbitrary code execution). Convert them to safetensors with the tool that wrote them.")
    raise CheckpointError(f"{d}: no model.safetensors or model.safetensors.index.json found")
