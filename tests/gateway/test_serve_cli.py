"""`pagegate serve` flags map onto EngineConfig / GatewayConfig; `pagegate` dispatches its commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagegate.__main__ import main, modules_to_import_beside
from pagegate.gateway.cli import build_parser, configs_from_args


def configs(*argv: str):
    return configs_from_args(build_parser().parse_args(list(argv)))


def test_defaults() -> None:
    engine, gateway = configs()
    assert engine.model is None and gateway.host == "127.0.0.1" and gateway.port == 8000
    assert gateway.api_keys == [] and engine.cache.enable_prefix_caching is True


def test_every_flag(monkeypatch) -> None:
    monkeypatch.setenv("PAGEGATE_API_KEY", "from-env")
    engine, gateway = configs(
        "--model", "/m", "--served-model-name", "a", "b", "--host", "0.0.0.0", "--port", "9000",
        "--api-key", "k1", "--api-key", "k2", "--dtype", "float32", "--device", "cpu", "--block-size", "32",
        "--num-kv-blocks", "100", "--kv-cache-memory", "1GiB", "--gpu-memory-utilization", "0.5",
        "--swap-space", "2", "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "1024",
        "--no-enable-prefix-caching", "--preemption-mode", "recompute", "--max-queue", "5",
        "--allowed-origins", "http://a.example,http://b.example", "--log-level", "debug",
        "--max-request-size", "1MiB", "--key-slice-tokens", "0")
    assert engine.model == "/m" and engine.served_model_name == "a" and gateway.served_model_names == ["a", "b"]
    assert (gateway.host, gateway.port) == ("0.0.0.0", 9000) and gateway.api_keys == ["k1", "k2", "from-env"]
    assert (engine.dtype, engine.device) == ("float32", "cpu")
    cache, scheduler = engine.cache, engine.scheduler
    assert (cache.block_size, cache.num_kv_blocks, cache.kv_cache_memory) == (32, 100, "1GiB")
    assert (cache.gpu_memory_utilization, cache.swap_space, cache.enable_prefix_caching) == (0.5, 2.0, False)
    assert (scheduler.max_model_len, scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (512, 8, 1024)
    assert scheduler.preemption_mode == "recompute" and gateway.max_queue == 5 and scheduler.key_slice_tokens == 0
    assert gateway.allowed_origins == ["http://a.example", "http://b.example"]
    assert gateway.log_level == "debug" and gateway.max_request_bytes == 1024**2


def test_unbounded_queue_and_positional_model() -> None:
    engine, gateway = configs("/some/model", "--max-queue", "-1")
    assert engine.model == "/some/model" and gateway.max_queue is None


def test_main_dispatch(capsys) -> None:
    assert main(["--help"]) == 0 and "serve" in capsys.readouterr().out
    assert main(["version"]) == 0
    assert main(["bogus"]) == 2


@pytest.mark.parametrize(("args", "grpc"), [
    ([], True), (["--grpc-port", "0"], False), (["--grpc-port=0"], False), (["--grpc-port", "7000"], True),
    (["--grpc-port", "0", "--grpc-port=9"], True), (["--grpc-port=9", "--grpc-port", "0"], False),
    (["--port", "0"], True)])
def test_the_gateway_imports_its_renderer_and_grpc_server_beside_its_own_imports(args: list[str],
                                                                                 grpc: bool) -> None:
    """`pagegate serve` starts importing what its app imports on threads later (jinja2, the gRPC server) at once;
    the gRPC server only where the arguments do not turn it off (the last --grpc-port wins, as argparse has it)."""
    modules = modules_to_import_beside(args)
    assert modules[0] == "pagegate.engine.loading.chat_template"
    assert ("pagegate.gateway.grpc_server" in modules) == grpc


def test_console_entry_help() -> None:
    result = subprocess.run([sys.executable, "-m", "pagegate", "serve", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    for flag in ("--served-model-name", "--num-kv-blocks", "--enable-prefix-caching", "--max-queue",
                 "--allowed-origins", "--api-key", "--preemption-mode", "--swap-space"):
        assert flag in result.stdout


def test_simulate_is_dispatched() -> None:
    result = subprocess.run([sys.executable, "-m", "pagegate", "simulate", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "simulate" in result.stdout
