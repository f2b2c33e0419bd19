"""fsspec filesystem for l2fs, so Python data tools read and write L2 through `l2fs://host:port/path` URLs.

    fs = fsspec.filesystem("l2fs", master="127.0.0.1:8995", node_id="node-1")
    with fsspec.open("l2fs://127.0.0.1:8995/kv/a.bin", "wb") as f: f.write(b"...")

Registered through the `fsspec.specs` entry point (pyproject.toml). Files are whole objects in l2fs, so a
file opened for reading is fetched with one `Client.get` on first read (a miss raises FileNotFoundError) and a
file opened for writing is buffered and published atomically with one `Client.put` on close.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from l2fs.client import Client, FileInfo, NotFound
from l2fs.options import ClientOptions


class L2FileSystem(AbstractFileSystem):
    """fsspec view of one l2fs cluster (protocol "l2fs")."""

    protocol = "l2fs"
    root_marker = "/"

    def __init__(self, master: str | None = None, *, node_id: str | None = None, token: str | None = None,
                 token_file: str | None = None, tls_ca: str | None = None, timeout: float = 2.0,
                 short_circuit: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # the shared client options (l2fs.options): kwargs first, else the environment, else their defaults
        opts = ClientOptions.from_mapping({"master": master, "node_id": node_id, "token": token,
                                           "token_file": token_file, "tls_ca": tls_ca, "timeout": timeout})
        self.master = opts.master
        if not self.master:
            raise ValueError("l2fs: give master='HOST:PORT', an l2fs://HOST:PORT/ URL or $L2FS_MASTER")
        self.client = Client(self.master, **opts.client_kwargs(), short_circuit=short_circuit)

    # ------------------------------------------------------------ URLs
    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("l2fs://"):
            rest = path[len("l2fs://"):]
            path = rest[rest.index("/"):] if "/" in rest else "/"
        elif path.startswith("l2fs::"):
            path = path[len("l2fs::"):]
        path = path.rstrip("/")
        if not path.startswith("/"):
            path = "/" + path
        return path

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        if path.startswith("l2fs://"):
            netloc = path[len("l2fs://"):].split("/", 1)[0]
            if netloc:
                return {"master": netloc}
        return {}

    def unstrip_protocol(self, name: str) -> str:
        return name if name.startswith("l2fs://") else f"l2fs://{self.master}{self._strip_protocol(name)}"

    # ------------------------------------------------------------ metadata
    @staticmethod
    def _entry(info: FileInfo) -> dict[str, Any]:
        return {
            "name": info.path.rstrip("/") or "/",
            "size": 0 if info.is_dir else info.size,
            "type": "directory" if info.is_dir else "file",
            "mtime": info.mtime,
            "crc32c": info.crc32c,
            "nodes": list(info.nodes),
        }

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        info = self.client.stat(path)
        if info is None:
            if path == "/":
                return {"name": "/", "size": 0, "type": "directory", "mtime": 0.0}
            raise FileNotFoundError(path)
        return self._entry(info)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        try:
            infos = self.client.ls(path)
        except NotFound:
            raise FileNotFoundError(path) from None
        except Exception:
            info = self.client.stat(path)
            if info is None or info.is_dir:
                raise
            infos = [info]
        else:
            if not infos:
                one = self.client.stat(path)
                if one is None and path != "/":
                    raise FileNotFoundError(path)
                if one is not None and not one.is_dir:
                    infos = [one]
        entries = sorted((self._entry(i) for i in infos), key=lambda e: e["name"])
        return entries if detail else [e["name"] for e in entries]

    def exists(self, path: str, **kwargs: Any) -> bool:
        path = self._strip_protocol(path)
        return path == "/" or self.client.stat(path) is not None

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.client.mkdir(self._strip_protocol(path), parents=create_parents, exist_ok=False)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.client.mkdir(self._strip_protocol(path), parents=True, exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self.client.rmdir(self._strip_protocol(path))

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        info = self.client.stat(path)
        if info is None:
            raise FileNotFoundError(path)
        if info.is_dir:
            self.client.rmdir(path)
        elif not self.client.rm(path):
            raise FileNotFoundError(path)

    _rm = rm_file

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in sorted(paths, key=lambda p: p.count("/"), reverse=True):  # children before parents
            self.rm_file(p)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        """Atomic rename (a metadata operation on the master; no data is copied)."""
        p1, p2 = self._strip_protocol(path1), self._strip_protocol(path2)
        if p1 != p2:
            self.client.rename(p1, p2, overwrite=True)

    def created(self, path: str) -> dt.datetime:
        return self.modified(path)

    def modified(self, path: str) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.info(path)["mtime"], tz=dt.UTC)

    def ukey(self, path: str) -> str:
        info = self.info(path)
        return f"{info['crc32c']:08x}-{info['size']}"

    # ------------------------------------------------------------ data
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        data = self.client.get(path)
        if data is None:
            raise FileNotFoundError(path)
        return data if start is None and end is None else data[start:end]

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        if not self.client.put(path, value, if_absent=(mode == "create")) and mode == "create":
            raise FileExistsError(path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.pipe_file(path2, self.cat_file(path1))

    def put_file(self, lpath: str, rpath: str, callback: Any = None, mode: str = "overwrite",
                 **kwargs: Any) -> None:
        if os.path.isdir(lpath):
            self.makedirs(rpath, exist_ok=True)
            return
        with open(lpath, "rb") as f:
            data = f.read()
        if callback is not None:
            callback.set_size(len(data))
        self.pipe_file(rpath, data, mode=mode)
        if callback is not None:
            callback.relative_update(len(data))

    def get_file(self, rpath: str, lpath: str, callback: Any = None, outfile: Any = None,
                 **kwargs: Any) -> None:
        if self.isdir(rpath):
            os.makedirs(lpath, exist_ok=True)
            return
        data = self.cat_file(rpath)
        if callback is not None:
            callback.set_size(len(data))
        if outfile is not None:
            outfile.write(data)
        else:
            tmp = f"{lpath}.l2fs-tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, lpath)
        if callback is not None:
            callback.relative_update(len(data))

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> L2File:
        return L2File(self, self._strip_protocol(path), mode=mode, block_size=block_size,
                      autocommit=autocommit, cache_options=cache_options, **kwargs)


class L2File(AbstractBufferedFile):
    """Whole-object file: read = one get on first access; write = buffered, one atomic put on close."""

    def __init__(self, fs: L2FileSystem, path: str, mode: str = "rb", **kwargs: Any) -> None:
        if mode == "xb" and fs.exists(path):  # early; the put-if-absent at close is the real guard
            raise FileExistsError(path)
        kwargs.setdefault("cache_type", "all")
        if kwargs.get("block_size") is None:
            kwargs["block_size"] = 64 << 20
        super().__init__(fs, path, mode=mode, **kwargs)
        self._parts: list[bytes] = []

    def _fetch_range(self, start: int, end: int) -> bytes:
        data = self.fs.client.get(self.path)
        if data is None:
            raise FileNotFoundError(self.path)
        return data[start:end]

    def _initiate_upload(self) -> None:
        if self.mode == "ab":
            old = self.fs.client.get(self.path)
            if old:
                self._parts.append(old)

    def _upload_chunk(self, final: bool = False) -> bool:
        self._parts.append(self.buffer.getvalue())
        if final:
            data = b"".join(self._parts)
            self._parts = []
            created = self.fs.client.put(self.path, data, if_absent=(self.mode == "xb"))
            if self.mode == "xb" and not created:
                raise FileExistsError(self.path)
        return True
