"""Regenerate the committed gRPC stubs from pagegate.proto: `python -m pagegate.gateway.proto.generate`.

The stubs are committed so installing pagegate needs no grpcio-tools (a test-only dependency);
tests/gateway/test_grpc.py regenerates them into a temporary folder and fails when they differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parents[2]
PROTO = PROTO_DIR.relative_to(REPO_ROOT) / "pagegate.proto"  # pagegate/gateway/proto/pagegate.proto
STUB_NAMES = ("pagegate_pb2.py", "pagegate_pb2.pyi", "pagegate_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Run protoc (grpcio-tools) with the repository root as include path, so the stubs import each
    other as `pagegate.gateway.proto...`; returns the written stubs under `out_root`."""
    from grpc_tools import protoc

    include = protoc._get_resource_file_name("grpc_tools", "_proto")  # google/protobuf/*.proto
    args = ["grpc_tools.protoc", f"-I{REPO_ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_root / PROTO.parent / name for name in STUB_NAMES]


def main() -> int:
    for path in generate(REPO_ROOT):
        print("wrote", path.relative_to(REPO_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
