"""Start-up and shutdown: /health is 503 while loading; SIGTERM ends streams, frees pages, exits 0."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx

from pagegate.testing.launcher import ServerProcess, cores_stopped, free_port, wait_for
from tests.gateway.server_args import server_args

ARGS = server_args("--num-kv-blocks", "80", "--max-model-len", "1024")


def test_loading_503_then_serving_line_then_clean_sigterm() -> None:
    port = free_port()
    command = [sys.executable, "-m", "pagegate", "serve", "--port", str(port), *ARGS]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    seen: list[int] = []

    def serving_or_gone() -> bool:
        try:
            seen.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code)
        except httpx.HTTPError:
            pass  # not listening yet
        return 200 in seen or process.poll() is not None

    try:
        wait_for(serving_or_gone, "/health to answer 200", timeout_s=180, poll_s=0.02)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {seen[-3:]} {''.join(output)[-3000:]}") from exc
    assert seen and seen[0] == 503 and seen[-1] == 200, (seen[-3:], "".join(output)[-3000:])
    base = f"http://127.0.0.1:{port}"
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    assert started.wait(60), "the stream never started"
    with cores_stopped(process.pid):  # it cannot finish before the signal, however fast the machine
        process.terminate()
        streamer.join(30)
    assert process.wait(60) == 0
    reader.join(5)
    log = "".join(output)
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    assert f"at http://127.0.0.1:{port}/v1" in log and "pages" in log, log[-2000:]


def test_bad_flag_fails_fast() -> None:
    result = subprocess.run([sys.executable, "-m", "pagegate", "serve", "--no-such-flag"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "--no-such-flag" in result.stderr


def test_missing_model_folder_exits_non_zero() -> None:
    server = ServerProcess(["--model", "/nonexistent/model", "--device", "cpu"], startup_timeout_s=120)
    try:
        server.start()
        raise AssertionError("a server without a model became healthy")
    except RuntimeError as exc:
        assert "exited with 1" in str(exc)
