"""What the benchmarks that drive one `pagegate serve` through the SDKs share: their model, their common flags and
the server's command line."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
RESULTS = ROOT / "bench/results"


def served_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the flags every such benchmark takes: --model (SmolLM2 Q4_1) and --server-args."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--server-args", default="", help="more flags for pagegate serve")
    return parser


def serve_args(args: argparse.Namespace, *flags: str) -> list[str]:
    """`pagegate serve`'s flags: the model on the CPU, no access log, no gRPC port, `flags`, then --server-args."""
    return ["--model", args.model, "--device", "cpu", "--disable-uvicorn-access-log", "--grpc-port", "0", *flags,
            *args.server_args.split()]
