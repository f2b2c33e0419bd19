"""Error kinds travel as codes (errno names), never as message text the receiver has to parse."""

from __future__ import annotations

import errno

import pytest

from l2fs.client import InvalidArgument, InvalidPath, _check
from l2fs.common import MAX_NAME_LEN, PathError, norm_path

pytestmark = pytest.mark.unit


def test_path_errors_name_their_errno() -> None:
    with pytest.raises(PathError) as e:
        norm_path("/" + "a" * (MAX_NAME_LEN + 1))
    assert e.value.errno_name == "ENAMETOOLONG"
    with pytest.raises(PathError) as e:
        norm_path("relative")
    assert e.value.errno_name == "EINVAL"
    with pytest.raises(InvalidPath) as ei:
        _check("/" + "b" * (MAX_NAME_LEN + 1))
    assert ei.value.errno == errno.ENAMETOOLONG


def test_mount_maps_by_code_not_text() -> None:
    fuse = pytest.importorskip("l2fs.fuse")
    worded = InvalidArgument("file exceeds the max file size; path longer than anything")
    assert fuse.errno_of(worded) == errno.EINVAL  # the words alone decide nothing
    coded = InvalidArgument("no telling words here")
    coded.errno = errno.EFBIG
    assert fuse.errno_of(coded) == errno.EFBIG


def test_resource_exhausted_is_busy_not_an_outage() -> None:
    """A worker's load refusal (RESOURCE_EXHAUSTED) is Busy: still an Unavailable (skip / try another worker),
    but distinguishable, so the LMCache plugin's breaker does not take all of L2 down for one busy worker;
    a prefix quota refusal (EDQUOT) stays QuotaExceeded."""
    import grpc

    from l2fs.client import Busy, QuotaExceeded, Unavailable, _exception, _with_errno

    e = _exception(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many bytes promised", None)
    assert isinstance(e, Busy) and isinstance(e, Unavailable)
    assert not isinstance(_exception(grpc.StatusCode.UNAVAILABLE, "down", None), Busy)
    q = _with_errno(_exception(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", None), errno.EDQUOT)
    assert isinstance(q, QuotaExceeded) and not isinstance(q, Unavailable)
