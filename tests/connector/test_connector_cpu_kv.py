"""The CPU paged-KV connector against vLLM's own CPU cache kernel (no engine needed).

vLLM's `cpu_attn_reshape_and_cache` writes known K/V at known slots; our connector must read exactly those
back (L0 -> L1) and write them into an empty cache so that it equals the kernel-written one (L1 -> L0).
This pins the layout independently of our own code.
"""

from __future__ import annotations

import pytest
import torch

vllm_ops = pytest.importorskip("vllm._custom_ops")

from connector.cpu_kv_connector import CPUPagedKVConnector  # noqa: E402 - after vLLM, like the hook

L, H, D, BS, NB = 3, 2, 64, 128, 8


def _caches() -> list[torch.Tensor]:
    return [torch.zeros(NB, H, BS, 2 * D) for _ in range(L)]


def _kernel_write(caches: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    for layer, c in enumerate(caches):
        view = c.view(NB, H, 2 * BS, D)
        kc, vc = view.chunk(2, dim=2)
        vllm_ops.cpu_attn_reshape_and_cache(k[layer], v[layer], kc, vc, slots, "vec")


class _Md:
    kv_shape = (L, 2, 256, H, D)
    use_mla = False
    kv_dtype = torch.float32


def _alloc(n: int):
    from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat

    return AdHocMemoryAllocator("cpu").allocate(torch.Size([2, L, n, H * D]), torch.float32,
                                                MemoryFormat.KV_2LTD)


def test_roundtrip_matches_vllm_kernel_layout() -> None:
    torch.manual_seed(0)
    n_tok = 300
    slots = torch.randperm(NB * BS)[:n_tok].to(torch.long)
    k = torch.randn(L, n_tok, H, D)
    v = torch.randn(L, n_tok, H, D)
    src = _caches()
    _kernel_write(src, k, v, slots)

    conn = CPUPagedKVConnector.from_metadata(_Md())
    assert conn.get_shape(n_tok) == torch.Size([2, L, n_tok, H * D])
    obj = _alloc(n_tok)
    conn.from_gpu(obj, 0, n_tok, kvcaches=src, slot_mapping=slots)
    assert torch.equal(obj.tensor[0], k.reshape(L, n_tok, H * D))
    assert torch.equal(obj.tensor[1], v.reshape(L, n_tok, H * D))

    dst = _caches()
    conn.to_gpu(obj, 0, n_tok, kvcaches=dst, slot_mapping=slots)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("order", "direct"), [
    ([5, 1, 6], 1),  # three runs of one block: straight into the cache
    ([2, 3, 4], 1),  # one run (a fresh request's usual allocation)
    ([6, 7, 1, 2], 1),  # two runs
    ([7, 5, 3, 1, 6], 0),  # five runs (> MAX_DIRECT_RUNS): through the block image
])
def test_whole_block_load_is_strided_and_matches_vllm_kernel(order: list[int], direct: int) -> None:
    """vLLM's paged slot mapping (whole blocks, any block order) takes a whole-block path (runs of consecutive
    blocks copied straight into the cache, or a block image when there are many runs), and the cache it writes
    equals the one vLLM's kernel writes from the same K/V (other blocks untouched), also in a cache that is a
    slice of a larger allocation (a nonzero storage offset)."""
    torch.manual_seed(2)
    n_tok = len(order) * BS
    blocks = torch.tensor(order)
    slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)
    conn = CPUPagedKVConnector.from_metadata(_Md())
    obj = _alloc(n_tok)
    obj.tensor.copy_(torch.randn_like(obj.tensor))
    big = torch.full((L + 1, NB, H, BS, 2 * D), 7.0)
    dst = [big[i + 1] for i in range(L)]  # each layer's cache starts past the previous one's storage
    conn.to_gpu(obj, 0, n_tok, kvcaches=dst, slot_mapping=slots)
    assert (conn.fast_loads, conn.direct_loads) == (1, direct)
    ref = [c.fill_(7.0) for c in _caches()]
    k = obj.tensor[0].reshape(L, n_tok, H, D).contiguous()
    v = obj.tensor[1].reshape(L, n_tok, H, D).contiguous()
    _kernel_write(ref, k, v, slots)
    for a, b in zip(ref, dst, strict=True):
        assert torch.equal(a, b)
    assert bool((big[0] == 7.0).all())  # nothing written before the first layer's cache
    # a chunk that does not fill whole blocks in order takes the per-element path
    odd = slots.clone()
    odd[:2] = odd[:2].flip(0)
    conn.to_gpu(obj, 0, n_tok, kvcaches=dst, slot_mapping=odd)
    assert conn.fast_loads == 1


def test_load_skips_vllm_cached_prefix_and_padding() -> None:
    torch.manual_seed(1)
    n_tok = 256
    slots = torch.arange(n_tok, dtype=torch.long) + 3 * BS
    slots[-5:] = -1  # padding
    conn = CPUPagedKVConnector.from_metadata(_Md())
    obj = _alloc(n_tok)
    obj.tensor.copy_(torch.randn_like(obj.tensor))
    dst = _caches()
    conn.to_gpu(obj, 0, n_tok, kvcaches=dst, slot_mapping=slots, vllm_cached_tokens=100)
    # reference: vLLM's kernel writes only tokens [100, n_tok-5) (the prefix is vLLM's own, the tail is padding)
    ref = _caches()
    sel = slice(100, n_tok - 5)
    k = obj.tensor[0, :, sel].reshape(L, -1, H, D).contiguous()
    v = obj.tensor[1, :, sel].reshape(L, -1, H, D).contiguous()
    _kernel_write(ref, k, v, slots[sel])
    for a, b in zip(ref, dst, strict=True):
        assert torch.equal(a, b)
    assert int(torch.count_nonzero(dst[0])) == 2 * (n_tok - 105) * H * D


def test_rejects_unknown_layout() -> None:
    conn = CPUPagedKVConnector.from_metadata(_Md())
    obj = _alloc(4)
    with pytest.raises(RuntimeError, match="unexpected vLLM CPU KV cache layout"):
        conn.from_gpu(obj, 0, 4, kvcaches=[torch.zeros(2, NB, BS, H, D)] * L, slot_mapping=torch.arange(4))


def test_hook_patches_create_gpu_connector_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from connector import cpu_kv; cpu_kv.install();"
        "assert not [m for m in sys.modules if m.startswith('lmcache')], 'install() imported LMCache';"
        "import lmcache.v1.gpu_connector as g; assert g.CreateGPUConnector._kvtier_cpu;"
        "assert 'connector.cpu_kv_connector' not in sys.modules, 'class module imported before first use';"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "KVTIER_CPU_CONNECTOR": "0"})
    assert off.returncode != 0  # disabled: stock LMCache, nothing patched
