"""The gRPC client needs grpcio and protobuf only: never torch, numpy, pydantic, starlette or the engine,
and `import pagegate.clients` alone does not even load grpc."""

from __future__ import annotations

import subprocess
import sys

HEAVY = "'torch', 'numpy', 'starlette', 'pydantic', 'uvicorn'"  # (grpc itself may load grpc_tools)
ALLOWED_GATEWAY = ("pagegate.gateway", "pagegate.gateway.proto", "pagegate.gateway.proto.pagegate_pb2",
                   "pagegate.gateway.proto.pagegate_pb2_grpc", "pagegate.gateway.proto.convert")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_grpc_client_imports_light() -> None:
    code = ("import sys\n"
            "from pagegate.clients import AsyncGrpcClient, GrpcClient\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in ({HEAVY}) "
            "or m.startswith(('pagegate.engine', 'pagegate.core', 'pagegate.kernels')) "
            f"or (m.startswith('pagegate.gateway') and m not in {ALLOWED_GATEWAY!r}))\n"
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = _run(code)
    assert result.returncode == 0, result.stdout + result.stderr


def test_plain_clients_import_does_not_load_grpc() -> None:
    result = _run("import sys, pagegate.clients; sys.exit(1 if 'grpc' in sys.modules else 0)")
    assert result.returncode == 0, result.stdout + result.stderr


def test_same_method_names_as_the_msgpack_client() -> None:
    from pagegate.clients import AsyncGrpcClient, AsyncMsgpackClient, GrpcClient, MsgpackClient

    def public(cls: type) -> set[str]:
        return {name for name in vars(cls) if not name.startswith("_")}

    assert public(MsgpackClient) <= public(GrpcClient) | {"close"}
    assert public(AsyncMsgpackClient) <= public(AsyncGrpcClient) | {"aclose"}
