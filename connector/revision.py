"""Model revision id: a short hash of a model's weights identity, for one L2 namespace per revision.

Why: LMCache's chunk key holds the model *name* (on HyperPod always /opt/ml/model), never the weights. Two
models of one architecture but different weights would load each other's KV (wrong answers, silently), so
`kvtier lmcache-config` puts each revision's chunks under their own l2fs prefix
(`kvtier.contract.revision_prefix`).

What is hashed (sha256, first 12 hex digits), and why:
* `config.json`, whole: architecture, dtype, rope settings all change the KV.
* every weight file (*.safetensors, *.bin, *.pt, *.pth, *.gguf, recursive, sorted by relative path): its
  relative path and size, and
  - safetensors: the header (8-byte length + JSON: tensor names, dtypes, shapes, offsets), then the tensor
    bytes: streamed whole when the file is at most `full_limit` bytes (default 64 MiB: small models,
    every byte counts), otherwise SAMPLES windows of 1 MiB spread evenly over the data plus its last
    MiB. Reading 100+ GB of weights at every pod start is too slow; a fine-tune or a re-quantisation
    changes bytes everywhere, so samples catch it, but a change confined to unsampled bytes is NOT seen:
    pass an explicit `--model-revision` (or full_limit=None) when that matters.
  - other weight formats: the same full/sampled digest of the whole file.
* NOT hashed: mtimes, owners, tokenizer files (token ids, not text, enter the key), README etc.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
FULL_LIMIT = 64 << 20
WINDOW = 1 << 20
SAMPLES = 64


def _digest_range(h: Any, f: BinaryIO, start: int, end: int, full_limit: int | None) -> None:
    """Feed bytes [start, end) of the open file `f` into `h`: all of them, or evenly spaced windows."""
    n = end - start
    if full_limit is None or n <= full_limit:
        f.seek(start)
        left = n
        while left > 0:
            buf = f.read(min(left, 8 << 20))
            if not buf:
                break
            h.update(buf)
            left -= len(buf)
        return
    step = (n - WINDOW) // (SAMPLES - 1)
    for off in [start + i * step for i in range(SAMPLES - 1)] + [end - WINDOW]:
        f.seek(off)
        h.update(struct.pack("<Q", off))
        h.update(f.read(WINDOW))


def file_digest(path: Path, full_limit: int | None = FULL_LIMIT) -> str:
    """Digest of one weight file (see the module doc for what is covered)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(struct.pack("<Q", size))
    with path.open("rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if 8 + hlen <= size:
                h.update(f.read(hlen))  # the header always counts in full: tensor names, dtypes, shapes
                start = 8 + hlen
        _digest_range(h, f, start, size, full_limit)
    return h.hexdigest()


def model_revision(model_dir: str | Path, full_limit: int | None = FULL_LIMIT) -> str:
    """Revision id of a local model directory (12 hex digits); ValueError when it holds no model."""
    root = Path(model_dir)
    cfg = root / "config.json"
    weights = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not cfg.is_file() and not weights:
        raise ValueError(f"{root} has neither config.json nor weight files: cannot derive a model revision")
    h = hashlib.sha256(b"kvtier-model-revision-v1\0")
    if cfg.is_file():
        h.update(b"config.json\0" + cfg.read_bytes() + b"\0")
    for p in weights:
        entry = {"path": p.relative_to(root).as_posix(), "digest": file_digest(p, full_limit)}
        h.update(json.dumps(entry, sort_keys=True).encode() + b"\0")
    return h.hexdigest()[:12]
