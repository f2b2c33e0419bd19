"""A `sitecustomize.py` that patches one module of an installed package as it is imported, in a child process
(`sitecustomize`), or makes packages unimportable there (`hidden`: an image without LMCache).

Why: the key-drift tests play "the next LMCache" (a hash that changed) inside real processes (a router's key
check child, an `lmcache server`) without touching the installed package: the child gets a PYTHONPATH dir
holding this sitecustomize, which wraps the named module's loader and runs `patch` on the fresh module.
"""

from __future__ import annotations

import textwrap

_TEMPLATE = r'''
import importlib.abc, importlib.util, sys

class _NextLMCache(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != {module!r}:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
{patch}

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _NextLMCache())
'''


def sitecustomize(module: str, patch: str) -> str:
    """The source: `patch` is the body run after `module` executed, with the fresh module bound to `module`."""
    return _TEMPLATE.format(module=module, patch=textwrap.indent(textwrap.dedent(patch).strip("\n"), " " * 12))



_HIDDEN = r'''
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
'''


def hidden(*modules: str) -> str:
    """A sitecustomize under which `modules` (top-level packages) are not importable: an image without them."""
    return _HIDDEN.format(modules=set(modules))
