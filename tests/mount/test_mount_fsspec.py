"""fsspec `l2fs` protocol against a real LocalCluster (entry point registration, URLs, file API)."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from l2fs.fsspec import L2FileSystem
from l2fs.testing.cluster import LocalCluster


@pytest.fixture
def fs(cluster: LocalCluster) -> L2FileSystem:
    return fsspec.filesystem("l2fs", master=cluster.master, node_id="node-2", skip_instance_cache=True)


def test_registered_by_entry_point(cluster: LocalCluster) -> None:
    assert fsspec.get_filesystem_class("l2fs") is L2FileSystem
    fs, path = fsspec.core.url_to_fs(f"l2fs://{cluster.master}/a/b.bin")
    assert isinstance(fs, L2FileSystem) and fs.master == cluster.master and path == "/a/b.bin"
    assert L2FileSystem._strip_protocol("l2fs://h:1/x/y/") == "/x/y"
    assert L2FileSystem._strip_protocol("/x") == "/x"


def test_url_open_write_read(cluster: LocalCluster, tmp_path: Path) -> None:
    url = f"l2fs://{cluster.master}/{tmp_path.name}/url.bin"
    data = os.urandom(3 << 20)
    with fsspec.open(url, "wb") as f:
        f.write(data[:1000])
        f.write(data[1000:])
    with fsspec.open(url, "rb") as f:
        assert f.read(10) == data[:10]
        f.seek(2 << 20)
        assert f.read() == data[2 << 20:]
    assert cluster.client().get(f"/{tmp_path.name}/url.bin") == data


def test_file_api(fs: L2FileSystem, cluster: LocalCluster, tmp_path: Path) -> None:
    d = f"/{tmp_path.name}"
    fs.makedirs(d + "/sub", exist_ok=True)
    fs.pipe_file(d + "/a", b"alpha")
    fs.pipe(d + "/sub/b", b"beta")
    assert fs.cat(d + "/a") == b"alpha"
    assert fs.cat_file(d + "/a", start=1, end=3) == b"lp"
    info = fs.info(d + "/a")
    assert info["type"] == "file" and info["size"] == 5 and info["name"] == d + "/a"
    assert info["nodes"] == ["node-2"]  # local-first placement for node_id="node-2"
    assert fs.info(d)["type"] == "directory"
    assert fs.ls(d, detail=False) == [d + "/a", d + "/sub"]
    assert {e["name"]: e["type"] for e in fs.ls(d)} == {d + "/a": "file", d + "/sub": "directory"}
    assert fs.ls(d + "/a", detail=False) == [d + "/a"]
    assert fs.find(d) == [d + "/a", d + "/sub/b"]
    assert fs.glob(d + "/*") == [d + "/a", d + "/sub"]
    assert fs.exists(d + "/a") and not fs.exists(d + "/zzz") and fs.isdir(d + "/sub") and fs.isfile(d + "/a")
    fs.mv(d + "/a", d + "/sub/a2")
    assert not fs.exists(d + "/a") and fs.cat(d + "/sub/a2") == b"alpha"
    fs.cp_file(d + "/sub/a2", d + "/copy")
    assert fs.cat(d + "/copy") == b"alpha"
    # put/get with local files
    local = tmp_path / "local.bin"
    local.write_bytes(b"L" * 100_000)
    fs.put(str(local), d + "/up.bin")
    assert fs.cat(d + "/up.bin") == b"L" * 100_000
    fs.get(d + "/sub/a2", str(tmp_path / "down.bin"))
    assert (tmp_path / "down.bin").read_bytes() == b"alpha"
    # "xb" and pipe mode="create" refuse to overwrite
    with pytest.raises(FileExistsError):
        fs.pipe_file(d + "/copy", b"x", mode="create")
    with pytest.raises(FileExistsError):
        with fs.open(d + "/copy", "xb") as f:
            f.write(b"x")
    with fs.open(d + "/copy", "ab") as f:
        f.write(b"++")
    assert fs.cat(d + "/copy") == b"alpha++"
    # rm: files, then recursive
    fs.rm(d + "/copy")
    assert not fs.exists(d + "/copy")
    with pytest.raises(FileNotFoundError):
        fs.rm(d + "/copy")
    fs.rm(d, recursive=True)
    assert not fs.exists(d)
    assert cluster.client().stat(d) is None


def test_errors(fs: L2FileSystem, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError):
        fs.info(f"/{tmp_path.name}/missing")
    with pytest.raises(FileNotFoundError):
        fs.cat(f"/{tmp_path.name}/missing")
    with pytest.raises(FileNotFoundError):
        fs.ls(f"/{tmp_path.name}/missing")
    with pytest.raises(FileNotFoundError):
        fs.open(f"/{tmp_path.name}/missing", "rb")
    with pytest.raises(ValueError):
        fs.pipe_file(f"/{tmp_path.name}/" + "n" * 300, b"x")
    monkeypatch.delenv("L2FS_MASTER", raising=False)
    with pytest.raises(ValueError, match="master"):
        L2FileSystem(skip_instance_cache=True)


def test_fsspec_and_mount_see_the_same_files(cluster: LocalCluster, two_mounts: tuple, fs: L2FileSystem,
                                             tmp_path: Path) -> None:
    m1, _ = two_mounts
    (m1 / tmp_path.name).mkdir()
    (m1 / tmp_path.name / "via-mount").write_bytes(b"m")
    assert fs.cat(f"/{tmp_path.name}/via-mount") == b"m"
    fs.pipe_file(f"/{tmp_path.name}/via-fsspec", b"f")
    assert (m1 / tmp_path.name / "via-fsspec").read_bytes() == b"f"
