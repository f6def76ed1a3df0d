"""The IDX file format of (Fashion-)MNIST, read with numpy (gzip or raw).

An IDX file is a big-endian header -- a 4-byte magic ``0x00 0x00 <type> <ndim>`` (Fashion-MNIST:
type 0x08 = unsigned byte; images 0x00000803 = 2051, labels 0x00000801 = 2049), then ``ndim``
unsigned 32-bit sizes -- followed by the array in C order. Only the unsigned-byte type is read:
every (Fashion-)MNIST file uses it, and any other type is an error, never a silent reinterpretation.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

IDX_UBYTE = 0x08
IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions (N, rows, cols)
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension (N,)


def parse_idx(raw: bytes, source: str = "<bytes>") -> np.ndarray:
    """The array an IDX byte string holds (read-only ``uint8``); ``ValueError`` naming ``source``
    on a bad magic, an unsupported type or a size that disagrees with the header."""
    if len(raw) < 4:
        raise ValueError(f"{source}: {len(raw)} bytes, too short for an IDX header")
    zero, dtype_code, ndim = int.from_bytes(raw[:2], "big"), raw[2], raw[3]
    if zero != 0 or ndim == 0:
        raise ValueError(
            f"{source}: bad IDX magic {int.from_bytes(raw[:4], 'big')} "
            f"(images {IMAGES_MAGIC}, labels {LABELS_MAGIC})"
        )
    if dtype_code != IDX_UBYTE:
        raise ValueError(f"{source}: IDX data type 0x{dtype_code:02x}; only unsigned bytes (0x08) are read")
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape))
    if len(raw) - header != expected:
        raise ValueError(
            f"{source}: header says {shape} = {expected} bytes, the file holds {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def read_idx(path: str | Path, magic: int | None = None) -> np.ndarray:
    """Read an IDX file (``.gz`` decompressed on the fly); ``magic`` (2051 or 2049), when given,
    must match the file's."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if magic is not None and len(raw) >= 4 and int.from_bytes(raw[:4], "big") != magic:
        raise ValueError(f"{path}: IDX magic {int.from_bytes(raw[:4], 'big')}, expected {magic}")
    return parse_idx(raw, str(path))
