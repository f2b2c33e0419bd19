"""The CPU paged-KV connector class: L0 (vLLM's CPU paged KV cache) <-> L1 (LMCache memory objects), pure torch.

A plain subclass of LMCache's GPUConnectorInterface, so this module imports LMCache at the top. It is imported
only by `connector.cpu_kv`'s patched `CreateGPUConnector`, i.e. after LMCache (and so vLLM) is loaded:
importing LMCache before vLLM has registered its Triton overrides breaks vLLM start-up (see cpu_kv.py).

vLLM CPU layout (vllm 0.32, `CPUAttentionBackend`): one tensor per layer, shape
[num_blocks, num_kv_heads, block_size, 2 * head_size], which the kernels view as
[num_blocks, num_kv_heads, 2 * block_size, head_size] and split K / V; inside a block the order is ISA-specific
(K is transposed to [head_size, block_size] for "vec"), so `probe_block_layout` learns it from vLLM's own kernel.
LMCache's KV_2LTD memory objects are [2, num_layers, tokens, H * head_size] (token-major, the same as on CUDA,
so chunks are device-neutral).

Env: KVTIER_CPU_CONNECTOR_FAULT=zero_load makes loads write zeros (negative control for tests only).
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat

from kvtier import envs as kvtier_envs


class CPUPagedKVConnector(GPUConnectorInterface):
    """Copies KV between vLLM's CPU paged cache and LMCache memory objects (KV_2LTD).

    One flat view per layer; `probe_block_layout` gives each (K/V, head, token, dim)'s offset inside a block,
    so a slot mapping turns into one index_select / index_copy_ per layer and K/V.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.kvcaches: list[torch.Tensor] | None = None
        self._views: list[torch.Tensor] | None = None
        self._block_size = 0
        self._offsets: torch.Tensor | None = None
        self._strides: list[tuple[int, int, int, int]] | None = None  # per K/V: base, head, token, dim
        self.fast_loads = 0  # chunks loaded whole-block by strided copies (the bench and tests read it)
        self.direct_loads = 0  # of those, written straight into the cache run by run (no block image)
        self.fault = kvtier_envs.get("KVTIER_CPU_CONNECTOR_FAULT") or ""

    @classmethod
    def from_metadata(cls, metadata: Any) -> CPUPagedKVConnector:
        num_layers, kv, _chunk, num_kv_heads, head_size = metadata.kv_shape
        if metadata.use_mla or kv != 2:
            raise RuntimeError("kvtier CPU connector: MLA KV caches are not supported on CPU")
        return cls(num_layers, num_kv_heads, head_size, metadata.kv_dtype)

    # -- layout ---------------------------------------------------------------------------------------
    def initialize_kvcaches_ptr(self, **kwargs: Any) -> None:
        if "kvcaches" in kwargs and kwargs["kvcaches"] is not None:
            caches = list(kwargs["kvcaches"])
            if self.kvcaches is None or len(caches) != len(self.kvcaches) or any(
                    a.data_ptr() != b.data_ptr() for a, b in zip(caches, self.kvcaches, strict=True)):
                self.kvcaches = caches
                self._views = [self._layer_view(t) for t in caches]

    def _layer_view(self, t: torch.Tensor) -> torch.Tensor:
        """Flat 1-D view of one layer's cache; learns the in-block layout on first sight."""
        h, d = self.num_kv_heads, self.head_size
        if t.device.type != "cpu":
            raise RuntimeError(f"kvtier CPU connector got a {t.device} KV cache")
        if t.dim() != 4 or t.shape[1] != h or t.shape[3] != 2 * d or not t.is_contiguous():
            raise RuntimeError(
                f"kvtier CPU connector: unexpected vLLM CPU KV cache layout {tuple(t.shape)} "
                f"(expected [num_blocks, {h}, block_size, {2 * d}], contiguous)")
        if self._offsets is None or self._block_size != t.shape[2]:
            self._block_size = t.shape[2]
            self._offsets = probe_block_layout(h, self._block_size, d, t.dtype)
            self._strides = affine_strides(self._offsets)
        return t.view(-1)

    def _index(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat element indices [2, T*H*D] of K and V for each token, in KV_2LTD (token, head, dim) order."""
        assert self._offsets is not None
        bs = self._block_size
        block_elems = self._offsets.numel()
        slots = slots.to(torch.long)
        b = torch.div(slots, bs, rounding_mode="floor")
        o = slots - b * bs
        # offsets: [2, H, BS, D] -> pick per token [2, T, H, D]
        per_tok = self._offsets[:, :, o, :].permute(0, 2, 1, 3)
        return (per_tok + (b * block_elems).view(1, -1, 1, 1)).reshape(2, -1)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    def _prepare(self, memory_obj: Any, start: int, end: int, kwargs: dict) -> torch.Tensor:
        self.initialize_kvcaches_ptr(**kwargs)
        if self._views is None:
            raise ValueError("kvcaches must be provided")
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' should be provided in kwargs.")
        if memory_obj.tensor is None:
            raise ValueError("memory object has no tensor")
        if memory_obj.metadata.fmt != MemoryFormat.KV_2LTD:
            raise ValueError(f"kvtier CPU connector needs KV_2LTD objects, got {memory_obj.metadata.fmt}")
        return kwargs["slot_mapping"][start:end]

    # -- L0 -> L1 (store) -----------------------------------------------------------------------------
    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = self._prepare(memory_obj, start, end, kwargs).cpu()
        n = end - start
        idx = self._index(slots)
        dst = memory_obj.tensor
        assert self._views is not None
        for layer, flat in enumerate(self._views):
            for kv in (0, 1):
                out = dst[kv, layer, :n]
                if out.is_contiguous():
                    torch.index_select(flat, 0, idx[kv], out=out.view(-1))
                else:
                    out.copy_(flat.index_select(0, idx[kv]).view(out.shape))

    # -- L1 -> L0 (load) ------------------------------------------------------------------------------
    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        slots = self._prepare(memory_obj, start, end, kwargs).cpu().to(torch.long)
        n = end - start
        # Tokens that vLLM already holds (its own prefix cache) are skipped: another request may be
        # reading those blocks right now. Negative slots are padding.
        skip = min(n, max(0, int(kwargs.get("vllm_cached_tokens", 0)) - start))
        keep = slots >= 0
        if skip:
            keep[:skip] = False
        src = memory_obj.tensor
        if self.fault == "zero_load":
            src = torch.zeros_like(src)
        all_kept = bool(keep.all())
        if not all_kept:
            slots = slots[keep]
        if slots.numel() == 0:
            return
        if all_kept and self._load_blocks(src, slots, n):
            return
        idx = self._index(slots)
        assert self._views is not None
        for layer, flat in enumerate(self._views):
            for kv in (0, 1):
                part = src[kv, layer, :n]
                if not all_kept:
                    part = part[keep]
                flat.index_copy_(0, idx[kv], part.reshape(-1).to(flat.dtype))

    def _load_blocks(self, src: torch.Tensor, slots: torch.Tensor, n: int) -> bool:
        """Whole blocks at once: when the chunk fills whole cache blocks in order (vLLM's paged slot mapping)
        and the in-block layout is affine, each layer's K and V go into a block image by one strided copy and
        the images into the cache by one row index_copy_. Why: the per-element index_copy_ moved 0.4 GB/s at
        kv8b geometry, a fifth of the cross-node L2 read. False = not applicable (caller copies per element)."""
        bs, st = self._block_size, self._strides
        if (st is None or n % bs or n == 0 or self._views is None or not src.is_contiguous()
                or any(v.dtype != src.dtype for v in self._views)):  # a cast: the per-element path does it
            return False
        runs = slots.view(-1, bs)
        first = runs[:, 0]
        if bool((first % bs).any()) or not torch.equal(runs - first[:, None], torch.arange(bs).expand_as(runs)):
            return False
        blocks = torch.div(first, bs, rounding_mode="floor")
        h, d = self.num_kv_heads, self.head_size
        nb, elems = runs.shape[0], 2 * h * bs * d
        assert self._views is not None
        spans = _block_runs(blocks)
        if len(spans) <= MAX_DIRECT_RUNS:
            # blocks in a few consecutive runs (a fresh request's usual allocation): each run's K and V go
            # straight into the cache by one strided copy, no block image and no second copy
            for layer, flat in enumerate(self._views):
                for kv in (0, 1):
                    base, sh, stok, sd = st[kv]
                    part = src[kv, layer, :n].view(nb, bs, h, d)
                    for i, b0, k in spans:
                        dst = flat.as_strided((k, bs, h, d), (elems, stok, sh, sd),
                                              flat.storage_offset() + b0 * elems + base)
                        dst.copy_(part[i:i + k])
            self.fast_loads += 1
            self.direct_loads += 1
            return True
        img = torch.empty(nb, elems, dtype=src.dtype)
        for layer, flat in enumerate(self._views):
            for kv in (0, 1):
                base, sh, stok, sd = st[kv]
                dst = img.as_strided((nb, bs, h, d), (elems, stok, sh, sd), base)
                dst.copy_(src[kv, layer, :n].view(nb, bs, h, d))
            flat.view(-1, elems).index_copy_(0, blocks, img)
        self.fast_loads += 1
        return True

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)


# Up to this many runs of consecutive blocks, a chunk is copied into the cache run by run (2 x layers x runs
# strided copies); beyond it through a block image and one index_copy_ per layer (2 x layers + layers).
MAX_DIRECT_RUNS = 4


def _block_runs(blocks: torch.Tensor) -> list[tuple[int, int, int]]:
    """(index in the chunk, first block, length) of each run of consecutive block ids, in chunk order."""
    ids = blocks.tolist()
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            j, b0, k = out[-1]
            out[-1] = (j, b0, k + 1)
        else:
            out.append((i, b, 1))
    return out


def affine_strides(offsets: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """(base, head, token, dim) element strides of K and V inside a block when `offsets` [2, H, BS, D] is
    affine in (head, token, dim) and K and V together fill the block exactly once; else None (a tiled
    layout: the per-element path)."""
    out = []
    for kv in (0, 1):
        o = offsets[kv]
        base = int(o[0, 0, 0])
        sh = int(o[1, 0, 0]) - base if o.shape[0] > 1 else 0
        st = int(o[0, 1, 0]) - base if o.shape[1] > 1 else 0
        sd = int(o[0, 0, 1]) - base if o.shape[2] > 1 else 0
        h, t, d = (torch.arange(x).view(*s) for x, s in zip(o.shape, ((-1, 1, 1), (1, -1, 1), (1, 1, -1)),
                                                               strict=True))
        if not torch.equal(o, base + h * sh + t * st + d * sd):
            return None
        out.append((base, sh, st, sd))
    if torch.unique(offsets).numel() != offsets.numel():
        return None
    return out


def _vllm_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(dtype, block_size, head_size)
    except Exception:  # noqa: BLE001 - older/newer vLLM: the portable kernel
        return "vec"


def probe_block_layout(num_heads: int, block_size: int, head_size: int, dtype: torch.dtype,
                       isa: str | None = None) -> torch.Tensor:
    """Element offsets [2(K/V), H, block_size, head_size] of each KV element inside one cache block.

    Why: the CPU kernels store blocks in an ISA-specific order (e.g. K transposed to [D, block_size] for
    "vec"). Rather than hard-coding it we ask vLLM's own `cpu_attn_reshape_and_cache` to write tagged
    values into one block and read back where each (token, head, dim) landed. Three passes tag token,
    head and dim separately so every tag stays exactly representable in bf16/fp16.
    """
    import vllm._custom_ops as ops

    h, bs, d = num_heads, block_size, head_size
    isa = isa or _vllm_isa(dtype, bs, d)
    tags = []
    grids = torch.meshgrid(torch.arange(bs), torch.arange(h), torch.arange(d), indexing="ij")  # [bs, h, d]
    for g in grids:
        cache = torch.zeros(1, h, bs, 2 * d, dtype=dtype)
        kc, vc = cache.view(1, h, 2 * bs, d).chunk(2, dim=2)
        val = (g + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(val, -val, kc, vc, torch.arange(bs, dtype=torch.long), isa)
        tags.append(cache.view(-1).to(torch.float32))
    kind = torch.sign(tags[0])  # +1 K, -1 V, 0 unused
    t, hh, j = (tags[0].abs() - 1).long(), (tags[1].abs() - 1).long(), (tags[2].abs() - 1).long()
    offsets = torch.full((2, h, bs, d), -1, dtype=torch.long)
    pos = torch.arange(kind.numel())
    used = kind != 0
    kv = (kind[used] < 0).long()
    offsets[kv, hh[used], t[used], j[used]] = pos[used]
    if int(used.sum()) != 2 * h * bs * d or bool((offsets < 0).any()):
        raise RuntimeError(f"kvtier CPU connector: cannot map vLLM's CPU KV block layout (isa={isa})")
    return offsets
