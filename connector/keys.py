"""Reversible l2fs file names for LMCache keys.

Why: model names contain '/' (and may contain '@' or '%'), chunk hashes can be negative, and LMCache's own
fs connector mangling ("/" -> "-SEP-") is neither safe nor reversible. Every field is percent-escaped on
its own, joined by '@', so `name_to_key(key_to_name(k)) == k` for any key, and each name is one l2fs path
component. Layout: <prefix>/<escaped model>/<name>.data (one directory per model, for listing/eviction).
The naming is the L2 key contract (kvtier.contract, shared with the router); parsing names back into
LMCache keys needs LMCache and stays here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from kvtier.contract import SUFFIX, esc, model_dir, plugin_name

__all__ = ["SUFFIX", "esc", "key_path", "key_to_name", "model_dir", "name_to_key", "name_to_object_key",
           "object_key_name", "object_key_path"]


def key_to_name(key: Any) -> str:
    """CacheEngineKey -> file name (no directory); the naming itself is kvtier.contract.plugin_name."""
    return plugin_name(key.model_name, key.world_size, key.worker_id, key.chunk_hash, key._dtype_str,
                       tuple(key.tags or ()))


def name_to_key(name: str) -> Any:
    """File name -> CacheEngineKey; ValueError for names we did not write."""
    from lmcache.utils import STR_DTYPE_TO_TORCH_DTYPE, CacheEngineKey

    if not name.endswith(SUFFIX):
        raise ValueError(f"not a kvtier chunk name: {name!r}")
    parts = name[: -len(SUFFIX)].split("@")
    if len(parts) < 5:
        raise ValueError(f"not a kvtier chunk name: {name!r}")
    configs = None
    if len(parts) > 5:
        configs = {}
        for kv in parts[5:]:
            k, sep, v = kv.partition("=")
            if not sep:
                raise ValueError(f"bad tag in chunk name: {name!r}")
            configs["lmcache.tag." + unquote(k)] = unquote(v)
    dtype = STR_DTYPE_TO_TORCH_DTYPE.get(unquote(parts[4]))
    if dtype is None:
        raise ValueError(f"unknown dtype in chunk name: {name!r}")
    return CacheEngineKey(model_name=unquote(parts[0]), world_size=int(parts[1]), worker_id=int(parts[2]),
                          chunk_hash=int(parts[3], 16), dtype=dtype, request_configs=configs)


def key_path(prefix: str, key: Any) -> str:
    return f"{model_dir(prefix, key.model_name)}/{key_to_name(key)}"


def object_key_name(key: Any) -> str:
    """MP-mode ObjectKey -> file name: model@kv_rank@group@hash_hex[@salt] (each field escaped)."""
    fields = [esc(key.model_name), format(int(key.kv_rank), "x"), format(int(key.object_group_id), "x"),
              bytes(key.chunk_hash).hex()]
    if key.cache_salt:
        fields.append(esc(key.cache_salt))
    return "@".join(fields) + SUFFIX


def name_to_object_key(name: str) -> Any:
    from lmcache.v1.distributed.api import ObjectKey

    if not name.endswith(SUFFIX):
        raise ValueError(f"not a kvtier object name: {name!r}")
    parts = name[: -len(SUFFIX)].split("@")
    if len(parts) not in (4, 5):
        raise ValueError(f"not a kvtier object name: {name!r}")
    salt = unquote(parts[4]) if len(parts) == 5 else ""
    return ObjectKey(chunk_hash=bytes.fromhex(parts[3]), model_name=unquote(parts[0]), kv_rank=int(parts[1], 16),
                     object_group_id=int(parts[2], 16), cache_salt=salt)


def object_key_path(prefix: str, key: Any) -> str:
    return f"{model_dir(prefix, key.model_name)}/{object_key_name(key)}"
