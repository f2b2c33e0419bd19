"""The router for replicas on LMCache's multiprocess server (`--l2fs-mode mp`: the webhook's --mode mp, `kvtier up
--lmcache-mode mp`): their L2 objects are named by the server's blake3 ObjectKeys, which the router's L2 lookup
does not compute, so it has none (it would only ever miss), whatever master deploy/router passes it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_mp_mode_has_no_l2_lookup_even_with_a_master() -> None:
    from router.cli import build_parser, l2_lookup_from_args

    flags = ["--l2fs-master", "127.0.0.1:1", "--l2fs-prefix", "/kvtier/kv"]
    assert l2_lookup_from_args(build_parser().parse_args([*flags, "--l2fs-mode", "mp"])) is None
    assert l2_lookup_from_args(build_parser().parse_args([*flags, "--l2fs-mode", "plugin"])) is not None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--l2fs-mode", "sidecar"])
