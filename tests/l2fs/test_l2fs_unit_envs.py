"""One home per setting: l2fs.envs holds every L2FS_* variable, and each l2fs command, the client and fsspec
take the node id (and the other client options) from the same place, checked through each one's own parser."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from l2fs import envs
from l2fs.options import ClientOptions

pytestmark = pytest.mark.unit

MASTER = "127.0.0.1:1"  # never contacted: parsers and constructors only


def _cli(tmp: Path) -> str:
    from l2fs.cli import _client_parser

    return _client_parser("ls").parse_args([]).node_id


def _mount(tmp: Path) -> str:
    pytest.importorskip("pyfuse3")
    from l2fs.fuse.main import parse_args

    return parse_args([str(tmp), "--master", MASTER]).node_id


def _passthrough(tmp: Path) -> str:
    pytest.importorskip("pyfuse3")
    from l2fs.fuse.passthrough import parse_args

    return parse_args([str(tmp), "--master", MASTER]).node_id


def _worker(tmp: Path) -> str:
    from l2fs.worker.main import build_parser

    return build_parser().parse_args(["--master", MASTER, "--data-dir", str(tmp)]).node_id


def _client(tmp: Path) -> str:
    from l2fs.client import Client

    with Client(MASTER) as c:
        return c.node_id


def _fsspec(tmp: Path) -> str:
    pytest.importorskip("fsspec")
    from l2fs.fsspec import L2FileSystem

    fs = L2FileSystem(MASTER, skip_instance_cache=True)
    try:
        return fs.client.node_id
    finally:
        fs.client.close()


def _options(tmp: Path) -> str:
    return ClientOptions.from_mapping({"master": MASTER}).node_id


USERS: dict[str, Callable[[Path], str]] = {"l2fs ls": _cli, "l2fs mount": _mount, "l2fs mount --passthrough":
                                           _passthrough, "l2fs worker": _worker, "Client": _client,
                                           "fsspec": _fsspec, "ClientOptions.from_mapping": _options}


@pytest.mark.parametrize("who", list(USERS))
def test_one_node_id_default_everywhere(who: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("L2FS_NODE_ID", raising=False)
    monkeypatch.delenv("L2FS_MASTER", raising=False)
    assert USERS[who](tmp_path) == socket.gethostname()
    monkeypatch.setenv("L2FS_NODE_ID", "")  # empty is unset
    assert USERS[who](tmp_path) == socket.gethostname()
    monkeypatch.setenv("L2FS_NODE_ID", "node-7")
    assert USERS[who](tmp_path) == "node-7"


@pytest.mark.parametrize("who", ["l2fs ls", "l2fs mount", "l2fs mount --passthrough", "l2fs worker"])
def test_each_command_takes_the_shared_client_flags(who: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The same flags, environment defaults and meaning in every command: one parser group (l2fs.options)."""
    pytest.importorskip("pyfuse3") if "mount" in who else None
    monkeypatch.setenv("L2FS_TOKEN", "t-env")
    monkeypatch.setenv("L2FS_TLS_CA", "/ca.pem")
    from l2fs.cli import _client_parser
    from l2fs.fuse import passthrough
    from l2fs.fuse.main import parse_args
    from l2fs.worker.main import build_parser

    extra = {"l2fs ls": [], "l2fs mount": [str(tmp_path)], "l2fs mount --passthrough": [str(tmp_path)],
             "l2fs worker": ["--data-dir", str(tmp_path)]}[who]
    parse = {"l2fs ls": _client_parser("ls").parse_args, "l2fs mount": parse_args,
             "l2fs mount --passthrough": passthrough.parse_args, "l2fs worker": build_parser().parse_args}[who]
    ns = parse([*extra, "--master", MASTER, "--token-file", str(tmp_path / "tok")])
    opts = ClientOptions.from_args(ns)
    assert (opts.master, opts.token, opts.tls_ca) == (MASTER, "t-env", "/ca.pem")
    assert opts.token_file == str(tmp_path / "tok")
    (tmp_path / "tok").write_text("t-file\n")
    source = opts.token_source()
    assert callable(source) and source() == "t-file"  # the file wins over the token, re-read per call


def test_envs_table() -> None:
    assert all(name.startswith("L2FS_") and v.name == name and v.meaning for name, v in envs.VARS.items())
    with pytest.raises(KeyError):
        envs.get("L2FS_NOT_A_SETTING")
    assert "| `L2FS_MASTER` |" in envs.table()


def test_empty_is_unset_and_defaults_come_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("L2FS_WORKER_AUDIENCE", "")
    assert envs.get("L2FS_WORKER_AUDIENCE") == envs.VARS["L2FS_WORKER_AUDIENCE"].default == "l2fs"
    from l2fs.master.main import build_parser

    assert build_parser().parse_args([]).worker_audience == "l2fs"
    monkeypatch.setenv("L2FS_WORKER_AUDIENCE", "aud")
    assert envs.L2FS_WORKER_AUDIENCE == "aud"
    assert build_parser().parse_args([]).worker_audience == "aud"
