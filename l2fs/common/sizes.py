"""Sizes: the default file size limit and the '1G' / '512MiB' parser every --size flag uses."""

from __future__ import annotations

import re

DEFAULT_MAX_FILE_SIZE = 1 << 30


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(i?[bB]?)\s*$")


def parse_size(text: str | int) -> int:
    """'10G', '512M', '1.5g', '4096' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"bad size {text!r} (use e.g. 512M, 10G)")
    mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * mult)
