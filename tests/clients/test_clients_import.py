"""`import pagegate.clients` needs httpx and msgpack only: never torch, never the engine."""

from __future__ import annotations

import subprocess
import sys


def test_clients_import_without_torch() -> None:
    code = ("import sys, pagegate.clients; "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'starlette') "
            "or m.startswith(('pagegate.engine', 'pagegate.core', 'pagegate.kernels', 'pagegate.gateway'))); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
