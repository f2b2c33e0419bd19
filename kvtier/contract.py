"""The L2 key contract: what every kvtier process must agree on for replicas to share KV chunks in l2fs.

Why one module: replicas (connector), the router (L2 presence lookup) and the operator patch (pod env and
LMCache config) each need the prefix, the key -> file naming, the chunk size, the hash algorithm and seed,
the plugin module path and the strategy names. A copy that drifts means silent L2 misses, so they live here,
at the bottom of the import graph: stdlib only, importing nothing of kvtier's packages.

Chunk hashes: LMCache 0.5.6's ChunkedTokenDatabase with `pre_caching_hash_algorithm: builtin` uses Python's
builtin `hash` (vLLM 0.32 has no "builtin" in `get_hash_fn_by_name`, so LMCache falls back to `hash`), chained
as h_i = hash((h_{i-1}, tuple(chunk_i), ())), starting from vLLM's NONE_HASH = hash(str(seed)) where seed is
the replicas' PYTHONHASHSEED (`vllm.v1.core.kv_cache_utils.init_none_hash`). Hashes of ints and tuples are
not randomized in CPython (>= 3.8, 64-bit), so only hash(str(seed)) depends on the seed: we compute it with
SipHash-1-3 (CPython >= 3.11's string hash) keyed the way CPython derives its key from PYTHONHASHSEED. The
router therefore needs neither LMCache nor the env var. tests/contract/test_contract_hash.py checks this
against real LMCache + vLLM keys and fails loudly when the versions below change.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
from collections.abc import Iterator, Sequence
from urllib.parse import quote

from kvtier import envs

# -- versions the chunk-hash reimplementation is verified against (tests assert them) ------------------
LMCACHE_VERSION = "0.5.6"
VLLM_VERSION = "0.32.0"
PYTHON_STR_HASH = "siphash13"  # the replicas' sys.hash_info.algorithm (CPython >= 3.11)

# -- layout ---------------------------------------------------------------------------------------------
KV_PREFIX = "/kvtier/kv"  # l2fs directory of KV chunks, both modes
MP_PREFIX = "/kvtier/mp"  # LMCache multi-process (MP) server chunks
META_PREFIX = "/kvtier/meta"  # key-compat fingerprints (connector.fingerprint)
SUFFIX = ".data"
L2_MODES = ("plugin", "mount")  # plugin: connector.lmcache_l2fs; mount: LMCache fs:// on an l2fs mount

# -- LMCache / replica settings -------------------------------------------------------------------------
CHUNK_SIZE = 256
HASH_ALGORITHM = "builtin"
HASH_SEED = "0"  # the replicas' PYTHONHASHSEED
PLUGIN_NAME = "l2fs"
PLUGIN_MODULE = "connector.lmcache_l2fs"
PLUGIN_CLASS = "L2fsConnectorAdapter"

# -- router ---------------------------------------------------------------------------------------------
STRATEGIES = ("roundrobin", "session", "prefixaware", "kvaware")
DEFAULT_STRATEGY = "prefixaware"
# Pod annotations the webhook writes and the router reads: the two chunk-key fields that differ per endpoint
# (besides the directory, kvtier.io/kv-prefix): LMCache's KV dtype string and the engine's world size
# (tensor x pipeline parallel; each rank stores its own chunks, rank 0's are looked up).
KV_DTYPE_ANNOTATION = "kvtier.io/kv-dtype"
KV_WORLD_SIZE_ANNOTATION = "kvtier.io/kv-world-size"
# vLLM --dtype / --kv-cache-dtype values -> the dtype string LMCache puts in its chunk keys
# (lmcache.utils.TORCH_DTYPE_TO_STR_DTYPE of the torch dtype vLLM allocates the KV cache in)
VLLM_TO_LMCACHE_DTYPE = {"bfloat16": "bfloat16", "float16": "half", "half": "half", "float32": "float",
                         "float": "float"}
LMCACHE_DTYPES = ("bfloat16", "half", "float", "double")


def pod_layout(annotations: dict[str, str] | None) -> tuple[str, int] | None:
    """(LMCache dtype, world size) a patched pod's chunk keys carry, from its annotations; None when either is
    missing or malformed (the router then uses its --l2fs-dtype / world size 1)."""
    ann = annotations or {}
    dtype, ws = str(ann.get(KV_DTYPE_ANNOTATION) or ""), str(ann.get(KV_WORLD_SIZE_ANNOTATION) or "")
    if dtype not in LMCACHE_DTYPES or not ws.isdigit() or int(ws) < 1:
        return None
    return dtype, int(ws)

# ======================================================================================================
# Plugin-mode names (connector.lmcache_l2fs): reversible, one directory per model.
# Every field is percent-escaped on its own and joined by '@', so a name always parses back
# (connector.keys.name_to_key) and is one l2fs path component: <prefix>/<escaped model>/<name>.data
# ======================================================================================================
_SAFE = "-_.+"  # everything else (incl. '/', '@', '%', '=') is %-escaped


def esc(s: object) -> str:
    return quote(str(s), safe=_SAFE)


def model_dir(prefix: str, model_name: str) -> str:
    return f"{prefix.rstrip('/')}/{esc(model_name)}"


MODEL_REVISION_ANNOTATION = "kvtier.io/model-revision"  # on an IEC (or Deployment): the revision, set by hand


def iec_revision(iec: dict) -> str:
    """Model revision of an endpoint, from its InferenceEndpointConfig (the webhook cannot read weights; `kvtier
    lmcache-config --iec` gives a hand-configured pod the same directory).

    The annotation kvtier.io/model-revision wins (set it after replacing weights in place at the same
    location). Else a hash of what names the weights: spec.modelName, modelSourceConfig (bucket, region,
    location, ... ; not prefetchEnabled) and any model version (spec.modelVersion, JumpStartModel-style
    spec.model.modelVersion), prefixed by that version when there is one, so the directory is readable."""
    import json

    ann = str(((iec.get("metadata") or {}).get("annotations") or {}).get(MODEL_REVISION_ANNOTATION) or "").strip()
    if ann:
        return ann
    spec = iec.get("spec") or {}
    source = {k: v for k, v in (spec.get("modelSourceConfig") or {}).items() if k != "prefetchEnabled"}
    model = spec.get("model") or {}
    version = str(spec.get("modelVersion") or model.get("modelVersion") or source.get("modelVersion") or "")
    ident = {"modelName": spec.get("modelName"), "source": source, "model": model, "version": version}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    return f"{version}-{digest[:8]}" if version else f"src-{digest[:12]}"


def revision_prefix(prefix: str, namespace: str, revision: str) -> str:
    """l2fs directory of one model revision's chunks: <prefix>/<endpoint or model>/<revision>.

    Why: every HyperPod endpoint serves its model from /opt/ml/model, which is the model name in LMCache's
    keys, so only the directory keeps two endpoints (or two weight versions of one) from loading each
    other's KV. Each part is one escaped path component; an empty revision keeps the plain prefix."""
    if not revision:
        return prefix.rstrip("/") or "/"
    if not namespace:
        raise ValueError("a model revision needs a namespace (endpoint or model name)")
    return f"{prefix.rstrip('/')}/{esc(namespace)}/{esc(revision)}"


# ======================================================================================================
# Tenant isolation: a secret salt per endpoint (or tenant) mixed into the chunk directory.
# Chunk hashes are computable from a prompt (below), so whoever can look a path up in l2fs (or time TTFT)
# can test what an endpoint was sent. With a salt, an endpoint revision's chunks live one level deeper,
# in <revision prefix>/salt@<HMAC-SHA256(salt, label)[:32 hex]>: writers (both L2 modes: the
# plugin's prefix and LMCache fs://'s base_path) and the router's L2 lookup compute the same directory,
# a party without the salt cannot. '@' is %-escaped in every plugin model directory, so a salt directory
# never collides with one; mount mode's flat files all end in ".data". No salt = the plain prefix.
# ======================================================================================================
SALT_ENV = "KVTIER_KV_SALT"  # the salt itself (tests, dev); a file is preferred in pods
SALT_FILE_ENV = "KVTIER_KV_SALT_FILE"  # path of a file holding the salt (a mounted Secret key)
SALT_SECRET_KEY = "salt"  # key of the salt in the endpoint's Secret
SALT_DIR_SECRET_KEY = "dir"  # key of the derived directory component (stock LMCache pods cannot hash)
SALT_DIR_TAG = "salt@"
SALT_MIN_BYTES = 16


def check_salt(salt: bytes | str) -> bytes:
    """The salt as bytes; ValueError when it is too short to be a secret (an empty salt means none)."""
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    raw = raw.strip()
    if len(raw) < SALT_MIN_BYTES:
        raise ValueError(f"a KV salt needs at least {SALT_MIN_BYTES} bytes of secret (e.g. `openssl rand -hex 32`),"
                         f" got {len(raw)}")
    return raw


def salt_component(salt: bytes | str) -> str:
    """Directory name a salt gives its chunks: HMAC-SHA256 keyed by the salt over a fixed label, so the
    name reveals nothing of the salt. It does not depend on the prefix on purpose: stock LMCache pods
    (mount mode) cannot hash, so the webhook hands them this name precomputed from the endpoint's Secret
    (key "dir"), and it must stay valid when the model revision (the directory above it) changes."""
    mac = hmac.new(check_salt(salt), b"kvtier-kv-salt-v1", hashlib.sha256)
    return SALT_DIR_TAG + mac.hexdigest()[:32]


def salted_prefix(prefix: str, salt: bytes | str | None) -> str:
    """l2fs directory of a (revision) prefix's chunks under `salt`; no/empty salt = `prefix` unchanged."""
    base = prefix.rstrip("/") or "/"
    if not salt:
        return base
    return f"{base.rstrip('/')}/{salt_component(salt)}"


def read_salt(path: str | os.PathLike[str]) -> bytes:
    """The salt held in a file (a mounted Secret key): its bytes without surrounding whitespace."""
    with open(path, "rb") as f:
        return check_salt(f.read())


def env_salt(environ: dict[str, str] | None = None) -> bytes | None:
    """The salt from KVTIER_KV_SALT_FILE (wins) or KVTIER_KV_SALT, else None (no salt: today's keys)."""
    get = envs.get if environ is None else environ.get  # kvtier.envs: the one reader of our variables
    if path := get(SALT_FILE_ENV):
        return read_salt(path)
    if salt := get(SALT_ENV):
        return check_salt(salt)
    return None


def plugin_name(model_name: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str,
                tags: Sequence[tuple[str, str]] = ()) -> str:
    """File name (no directory) of one LMCache chunk in plugin mode."""
    fields = [esc(model_name), str(int(world_size)), str(int(worker_id)), format(int(chunk_hash), "x"), esc(dtype)]
    fields += [f"{esc(k)}={esc(v)}" for k, v in tags]
    return "@".join(fields) + SUFFIX


def plugin_path(prefix: str, model_name: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str,
                tags: Sequence[tuple[str, str]] = ()) -> str:
    return f"{model_dir(prefix, model_name)}/{plugin_name(model_name, world_size, worker_id, chunk_hash, dtype, tags)}"


# ======================================================================================================
# Mount-mode names: what stock LMCache 0.5.6's fs connector (FSConnector._get_file_name) writes under
# base_path = <mount>/<prefix>: CacheEngineKey.to_string() with '/' replaced by "-SEP-", plus ".data",
# all in one flat directory. Not reversible (a model name may contain "-SEP-" or '@'); we only build them.
# ======================================================================================================
def mount_name(model_name: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str,
               tags: Sequence[tuple[str, str]] = ()) -> str:
    s = f"{model_name}@{int(world_size)}@{int(worker_id)}@{int(chunk_hash):x}@{dtype}"
    if tags:
        s += "@" + "@".join(f"{k}%{v}" for k, v in tags)
    return s.replace("/", "-SEP-") + SUFFIX


def mount_path(prefix: str, model_name: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str,
               tags: Sequence[tuple[str, str]] = ()) -> str:
    """l2fs path (not the local mount path) of a chunk LMCache's fs connector wrote on the mount."""
    return f"{prefix.rstrip('/')}/{mount_name(model_name, world_size, worker_id, chunk_hash, dtype, tags)}"


def chunk_path(mode: str, prefix: str, model_name: str, world_size: int, worker_id: int, chunk_hash: int,
               dtype: str) -> str:
    if mode == "plugin":
        return plugin_path(prefix, model_name, world_size, worker_id, chunk_hash, dtype)
    if mode == "mount":
        return mount_path(prefix, model_name, world_size, worker_id, chunk_hash, dtype)
    raise ValueError(f"unknown l2fs mode {mode!r}; choose one of {', '.join(L2_MODES)}")


# ======================================================================================================
# LMCache builtin chunk hashes (see the module docstring for why this matches)
# ======================================================================================================
_M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def _siphash13(k0: int, k1: int, data: bytes) -> int:
    """SipHash-1-3 as CPython's Python/pyhash.c computes it (unsigned 64-bit result)."""
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573

    def rnd() -> None:
        nonlocal v0, v1, v2, v3
        v0 = (v0 + v1) & _M64
        v2 = (v2 + v3) & _M64
        v1 = _rotl(v1, 13) ^ v0
        v3 = _rotl(v3, 16) ^ v2
        v0 = _rotl(v0, 32)
        v2 = (v2 + v1) & _M64
        v0 = (v0 + v3) & _M64
        v1 = _rotl(v1, 17) ^ v2
        v3 = _rotl(v3, 21) ^ v0
        v2 = _rotl(v2, 32)

    n = len(data)
    end = n - n % 8
    for i in range(0, end, 8):
        (m,) = struct.unpack_from("<Q", data, i)
        v3 ^= m
        rnd()
        v0 ^= m
    b = ((n & 0xFF) << 56) | int.from_bytes(data[end:], "little")
    v3 ^= b
    rnd()
    v0 ^= b
    v2 ^= 0xFF
    rnd()
    rnd()
    rnd()
    return (v0 ^ v1) ^ (v2 ^ v3)


def _hash_key(seed: int) -> tuple[int, int]:
    """CPython's SipHash key for PYTHONHASHSEED=seed: zero for 0, else its LCG bytes (lcg_urandom)."""
    if seed == 0:
        return 0, 0
    x, buf = seed, bytearray(16)
    for i in range(16):
        x = (x * 214013 + 2531011) & 0xFFFFFFFF
        buf[i] = (x >> 16) & 0xFF
    return int.from_bytes(buf[:8], "little"), int.from_bytes(buf[8:], "little")


def str_hash(s: str, seed: int) -> int:
    """hash(s) in a CPython >= 3.11 (64-bit) process started with PYTHONHASHSEED=seed."""
    if not s:
        return 0
    m = max(map(ord, s))
    data = s.encode("latin-1") if m < 256 else s.encode("utf-16-le") if m < 65536 else s.encode("utf-32-le")
    h = _siphash13(*_hash_key(seed), data)
    h = h - (1 << 64) if h >> 63 else h
    return -2 if h == -1 else h


def none_hash(seed: str | int = HASH_SEED) -> int:
    """vLLM's NONE_HASH for the builtin hash: hash(PYTHONHASHSEED string) (init_none_hash)."""
    text = str(seed)
    if not text.isdigit() or int(text) > 0xFFFFFFFF:
        raise ValueError(f"PYTHONHASHSEED must be an integer in [0, 4294967295], not {seed!r}")
    return str_hash(text, int(text))


def _check_interpreter() -> None:
    # int/tuple hashing is seed-free but is CPython's 64-bit xxHash-style tuple hash (3.8+)
    if sys.implementation.name != "cpython" or sys.hash_info.width != 64 or sys.version_info < (3, 8):
        raise RuntimeError("kvtier's chunk hashes need 64-bit CPython >= 3.8")


def iter_chunk_hashes(tokens: Sequence[int], chunk_size: int = CHUNK_SIZE,
                      seed: str | int = HASH_SEED) -> Iterator[int]:
    """LMCache's prefix-chained builtin chunk hashes of the FULL chunks of `tokens` (save_unfull_chunk off)."""
    _check_interpreter()
    h = none_hash(seed)
    for i in range(0, len(tokens) - len(tokens) % chunk_size, chunk_size):
        h = hash((h, tuple(int(t) for t in tokens[i:i + chunk_size]), ()))
        yield h


def chunk_hashes(tokens: Sequence[int], chunk_size: int = CHUNK_SIZE, seed: str | int = HASH_SEED) -> list[int]:
    return list(iter_chunk_hashes(tokens, chunk_size, seed))


# ======================================================================================================
# Key drift: known-answer vectors checked at start-up against the INSTALLED LMCache / vLLM.
# Why: everything above reimplements (or, for MP mode, pins) how LMCache and vLLM name a chunk. Another
# LMCache or vLLM that hashes differently would turn every router L2 lookup into a miss and every replica's
# L2 writes into files nobody finds, silently. So each component that computes chunk keys hashes KAT_TOKENS
# with the installed library at start-up and compares with the values here: the router (installed_builtin_
# check, in a subprocess with the replicas' seed) falls back to no L2 credit on a mismatch; engine-side
# components (connector.keycheck) stop writing L2. Verdicts: KEY_OK, KEY_DRIFT, KEY_UNVERIFIED (nothing to
# compare with here, e.g. no LMCache installed or a hash algorithm without a reference), KEY_PENDING.
# ======================================================================================================
KEY_OK, KEY_DRIFT, KEY_UNVERIFIED, KEY_PENDING = "ok", "drift", "unverified", "pending"
KEY_STATES = (KEY_OK, KEY_DRIFT, KEY_UNVERIFIED, KEY_PENDING)
KAT_TOKENS: tuple[int, ...] = tuple((i * 7919 + 13) % 50257 for i in range(2 * CHUNK_SIZE + 7))
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED
# LMCache 0.5.6 MP server (multiprocess/token_hasher.py, --hash-algorithm blake3, the default), chunk 256:
# blake3(prefix || tokens as big-endian u32), NONE_HASH = blake3 of (0, (0,), None) hashed the same way.
# blake3 is not in the stdlib, so these digests of KAT_TOKENS are pinned, not recomputed.
MP_BLAKE3_KAT = ("b072719b20284b65dc4bdd95be64c11ff51aa420903ed0f4aad58c9db208fc74",
                 "80e952bb4361f26b4584e3e8883b0e91ea7c019052e9f1bc93cb678d291435fe")


def builtin_chain(tokens: Sequence[int], chunk_size: int, start: int) -> list[int]:
    """The chained builtin hashes of the full chunks of `tokens` from a given NONE_HASH (seed-free: only ints
    and tuples are hashed), so an engine can check its installed library's chaining whatever its seed."""
    _check_interpreter()
    out, h = [], start
    for i in range(0, len(tokens) - len(tokens) % chunk_size, chunk_size):
        h = hash((h, tuple(int(t) for t in tokens[i:i + chunk_size]), ()))
        out.append(h)
    return out


def vllm_block_hashes(tokens: Sequence[int], block_size: int, seed: str | None = None) -> list[bytes]:
    """vLLM 0.32's prefix-caching block hashes with its default `sha256` (vllm.utils.hashing.sha256 =
    SHA-256 of pickle protocol 5; hash_block_tokens: (parent, tuple(tokens), extra_keys=None)), chained from
    NONE_HASH = sha256(seed), seed = PYTHONHASHSEED or vLLM's fixed default. What the native tier's keys are."""
    import pickle

    def sha(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    h = sha(VLLM_DEFAULT_NONE_HASH_SEED if seed is None else seed)
    out = []
    for i in range(0, len(tokens) - len(tokens) % block_size, block_size):
        h = sha((h, tuple(int(t) for t in tokens[i:i + block_size]), None))
        out.append(h)
    return out


# -- the engines' known-answer results, published for the router (connector.fingerprint writes, router.l2 reads)
# An engine-side component adds KAT_RECORD_FIELD to its key-compat record (/kvtier/meta/<model>/<replica>.json):
# the chunk keys ITS installed LMCache computed for KAT_TOKENS, with the chunk size and seed it used and its own
# verdict. The router (whose image has no LMCache) recomputes them here: a record that disagrees, or whose engine
# found drift itself, turns the router's L2 credit off. Records without the field (older engines) are no evidence.
KAT_RECORD_FIELD = "key_check"  # {"state", "detail", "chunk_size", "seed", "keys"}
KEY_RECORD_REFRESH_S = 300.0  # an engine rewrites its record this often (its l2fs mtime is the freshness)
KEY_RECORD_MAX_AGE_S = 3 * KEY_RECORD_REFRESH_S  # older records are a gone engine's: the router ignores them


def kat_record(state: str, chunk_size: int, seed: str, keys: Sequence[int], detail: str = "") -> dict[str, object]:
    """The KAT_RECORD_FIELD value an engine publishes: its verdict and the keys its library computed."""
    return {"state": state, "detail": detail[:300], "chunk_size": int(chunk_size), "seed": str(seed),
            "keys": [int(k) for k in keys]}


def kat_record_verdict(record: object) -> tuple[str, str] | None:
    """What one engine record says about its keys: (KEY_DRIFT | KEY_OK, detail), or None for no evidence (no
    KAT_RECORD_FIELD, no keys, a seed that is not fixed). ValueError for a malformed record (garbage).
    The keys are compared with chunk_hashes(KAT_TOKENS) for the record's own chunk size and seed: whether
    the engines' library hashes as this contract does; seed agreement is connector.fingerprint's check."""
    if not isinstance(record, dict):
        raise ValueError("a record is a JSON object")
    kc = record.get(KAT_RECORD_FIELD)
    if kc is None:
        return None
    if not isinstance(kc, dict) or kc.get("state") not in (KEY_OK, KEY_DRIFT, KEY_UNVERIFIED):
        raise ValueError(f"{KAT_RECORD_FIELD} is not an object with a known state")
    if kc["state"] == KEY_DRIFT:
        return KEY_DRIFT, f"its own key check found drift ({str(kc.get('detail') or '')[:200]})"
    keys, chunk, seed = kc.get("keys"), kc.get("chunk_size"), kc.get("seed")
    if not isinstance(keys, list) or not all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        raise ValueError(f"{KAT_RECORD_FIELD}.keys is not a list of integers")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= len(KAT_TOKENS):
        raise ValueError(f"{KAT_RECORD_FIELD}.chunk_size {chunk!r} is not a chunk size of KAT_TOKENS")
    if not keys or not isinstance(seed, str) or not seed.isdigit() or int(seed) > 0xFFFFFFFF:
        return None  # nothing computed, or a process whose string hash is not keyed by a fixed PYTHONHASHSEED
    want = chunk_hashes(KAT_TOKENS, chunk, seed)
    if keys != want:
        return KEY_DRIFT, (f"its installed LMCache computes other chunk keys for KAT_TOKENS than kvtier.contract "
                           f"(seed {seed}, chunk {chunk}): first {keys[:1]} != {want[:1]}")
    return KEY_OK, f"its chunk keys match kvtier.contract (seed {seed}, chunk {chunk})"


_LMCACHE_REFERENCE = r"""
import json, sys, types
from lmcache.v1.token_database import ChunkedTokenDatabase
req = json.loads(sys.stdin.read())
meta = types.SimpleNamespace(model_name="kvtier-kat", world_size=1, worker_id=0, kv_dtype=None, use_mla=False)
cfg = types.SimpleNamespace(chunk_size=req["chunk_size"], save_unfull_chunk=False, remote_url=None,
                            enable_pd=False, pre_caching_hash_algorithm="builtin",
                            get_extra_config_value=lambda k, d: d)
db = ChunkedTokenDatabase(cfg, meta)
print("KVTIER-KAT " + json.dumps([int(k) for _s, _e, k in db.process_tokens(tokens=req["tokens"], make_key=False)]))
"""
_PYTHON_REFERENCE = r"""
import json, os, sys
req = json.loads(sys.stdin.read())
h, t, n, out = hash(os.environ["PYTHONHASHSEED"]), req["tokens"], req["chunk_size"], []
for i in range(0, len(t) - len(t) % n, n):
    h = hash((h, tuple(t[i:i + n]), ()))
    out.append(h)
print("KVTIER-KAT " + json.dumps(out))
"""


def _run_reference(code: str, seed: str, chunk_size: int, python: str, timeout: float,
                   env: dict[str, str] | None) -> list[int] | None:
    import json
    import subprocess

    e = dict(os.environ if env is None else env, PYTHONHASHSEED=str(seed), LMCACHE_TRACK_USAGE="false")
    try:
        out = subprocess.run([python, "-c", code], input=json.dumps({"tokens": list(KAT_TOKENS),
                                                                     "chunk_size": chunk_size}),
                             capture_output=True, text=True, timeout=timeout, env=e)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("KVTIER-KAT ")]
    if out.returncode != 0 or not lines:
        return None
    return [int(x) for x in json.loads(lines[-1][len("KVTIER-KAT "):])]


def installed_builtin_check(seed: str | int = HASH_SEED, chunk_size: int = CHUNK_SIZE, *,
                            python: str | None = None, timeout: float = 180.0,
                            env: dict[str, str] | None = None) -> tuple[str, str]:
    """(verdict, detail): LMCache's builtin chunk keys of KAT_TOKENS as the installed LMCache computes them
    (a child `python` started with PYTHONHASHSEED=seed, as the replicas are) == chunk_hashes(...) here.
    Without an importable LMCache (a router image) the child checks CPython's own hash chain instead and the
    verdict is KEY_UNVERIFIED unless that already differs. Blocking (the LMCache import takes seconds)."""
    python = python or sys.executable
    want = chunk_hashes(KAT_TOKENS, chunk_size, seed)
    got = _run_reference(_LMCACHE_REFERENCE, str(seed), chunk_size, python, timeout, env)
    if got is not None:
        if got == want:
            return KEY_OK, f"installed LMCache's builtin chunk keys match kvtier.contract (seed {seed})"
        return KEY_DRIFT, (f"installed LMCache computes other chunk keys than kvtier.contract for the same tokens "
                           f"(seed {seed}, chunk {chunk_size}): first {got[:1]} != {want[:1]}")
    py = _run_reference(_PYTHON_REFERENCE, str(seed), chunk_size, python, timeout, env)
    if py is None:
        return KEY_UNVERIFIED, "could not run the reference interpreter"
    if py != want:
        return KEY_DRIFT, f"this CPython's hash chain differs from kvtier.contract's (seed {seed})"
    return KEY_UNVERIFIED, "LMCache is not importable here: only CPython's hash chain was checked (it matches)"
