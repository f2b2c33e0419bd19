"""A real router process finds a salted endpoint's L2 chunks only with that endpoint's salt (tenant isolation).

The chunks sit where a salted replica writes them (kvtier.contract.salted_prefix under --l2fs-prefix; names
and hashes as in test_router_l2/test_contract_hash). A router given the salt (env KVTIER_KV_SALT) counts
them; one without it, or with another tenant's salt, computes other paths and sees nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_helpers import PY, Proc, _spawn

from kvtier import contract

SALT_A = "tenant-a-0123456789abcdef"
SALT_B = "tenant-b-0123456789abcdef"
MODEL = "tiny-model"


def _router(cluster, l2_master: str, replica: str, log: Path) -> Proc:
    p, url = _spawn([PY, "-m", "router.cli", "--port", "0", "--replicas", replica, "--strategy", "kvaware",
                     "--l2fs-master", l2_master, "--l2fs-model-name", MODEL, "--l2fs-timeout", "5", "--l2fs-lookup", "always"], log,
                    r"listening on (http://\S+)", timeout=120)
    rt = Proc(p, url, log)
    cluster.procs.append(rt)
    assert httpx.get(url + "/health", timeout=300).status_code == 200
    return rt


def test_router_needs_the_endpoint_salt(cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        make_cluster: Callable[..., Any]) -> None:
    from l2fs.client import Client

    prompt = "".join(chr(65 + (i * 11) % 26) for i in range(800))  # bytes tokenizer: 800 tokens, 3 chunks
    hashes = contract.chunk_hashes(list(prompt.encode()))
    salted = contract.salted_prefix(contract.KV_PREFIX, SALT_A)
    l2 = make_cluster(1)
    with Client(l2.master) as c:
        for h in hashes:  # what endpoint A's replicas (plugin mode, salt A) wrote for this prompt
            c.put(contract.plugin_path(salted, MODEL, 1, 0, h, "float"), b"kv-bytes")
        rep = cluster.replica(kv=False)
        got = {}
        for name, salt in (("a", SALT_A), ("b", SALT_B), ("none", None)):
            monkeypatch.delenv(contract.SALT_FILE_ENV, raising=False)
            if salt:
                monkeypatch.setenv(contract.SALT_ENV, salt)
            else:
                monkeypatch.delenv(contract.SALT_ENV, raising=False)
            rt = _router(cluster, l2.master, rep.url, tmp_path / f"router-{name}.log")
            r = rt.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            got[name] = r.headers.get("x-kvtier-l2-tokens")
        assert got == {"a": str(3 * 256), "b": None, "none": None}
