"""Regenerate l2fs_pb2*.py (and the l2fs_pb2.pyi type stub) from l2fs.proto: `python -m l2fs.proto.build` (needs grpcio-tools, dev extra)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Compile the proto and make the generated grpc module import its sibling relatively."""
    from grpc_tools import protoc

    rc = protoc.main(["grpc_tools.protoc", f"-I{HERE}", f"--python_out={HERE}",
                      f"--grpc_python_out={HERE}", f"--pyi_out={HERE}", str(HERE / "l2fs.proto")])
    if rc != 0:
        return rc
    grpc_file = HERE / "l2fs_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import l2fs_pb2 as", "from . import l2fs_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    stub = HERE / "l2fs_pb2.pyi"  # generated like the modules: exempt from lint, read by the type checker
    stub.write_text("# ruff: noqa\n" + stub.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
