"""`pagegate serve ...` (the OpenAI-compatible server) and `pagegate simulate ...` (fragmentation simulator)."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import threading

USAGE = """usage: pagegate <command> [options]

commands:
  serve      serve a model behind an OpenAI-compatible API (pagegate serve --help)
  simulate   compare contiguous and paged KV allocation (pagegate simulate --help)
  version    print the version
"""


def gguf_to_read_ahead(args: list[str]) -> str | None:
    """The GGUF file `pagegate serve args` serves, read off the arguments before they are parsed: the one argument
    naming a .gguf file (`--model X`, `--model=X` or the positional; an --mmproj file or a `name=path` adapter is not
    a model). A guess the early core acts on, which the parsed configuration confirms or drops."""
    found = [value for value, before in zip((a.removeprefix("--model=") for a in args), ["", *args], strict=False)
             if value.lower().endswith(".gguf") and "=" not in value and before != "--mmproj"]
    return found[0] if len(found) == 1 else None


def modules_to_import_beside(args: list[str]) -> list[str]:
    """What the gateway of `pagegate serve args` imports on threads once its app runs, read off the arguments before
    they are parsed (a guess, as gguf_to_read_ahead's; the modules are imported again where they are used): the chat
    renderer's jinja2 and, unless `--grpc-port 0`, the gRPC server."""
    port = None
    for before, arg in zip(["", *args], args, strict=False):
        if before == "--grpc-port":
            port = arg
        elif arg.startswith("--grpc-port="):
            port = arg.removeprefix("--grpc-port=")
    return ["pagegate.engine.loading.chat_template", *(["pagegate.gateway.grpc_server"] if port != "0" else [])]


def import_beside(modules: list[str]) -> None:
    """Import `modules` on a thread, beside the gateway's own imports: done before its first model's tokenizer is
    built rather than after it (imported once the app ran, they shared the GIL with that build and ended after it:
    ~30-70 ms of a start-up). Their errors are the later imports' to report."""
    def run() -> None:
        for module in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(module)

    threading.Thread(target=run, name="import-beside", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "serve":
        # The gateway's imports make ~100k objects that live as long as it does: collecting while they were made
        # took ~50 ms of its start-up (137 collections); frozen, no later collection walks them again.
        gc.disable()
        try:
            if not {"-h", "--help"} & set(rest):
                from pagegate.engine.serving.core_spawn import start_early_core

                start_early_core(gguf_to_read_ahead(rest))  # its imports and reading run beside the imports below
                import_beside(modules_to_import_beside(rest))
            # pydantic looks for plugins in every installed package's entry points at its first model (~40 ms of
            # the gateway's start-up); pagegate's models use none. An operator's own setting wins.
            os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
            from pagegate.gateway.cli import main as serve
        finally:
            gc.freeze()
            gc.enable()
        return serve(rest)
    if command == "simulate":
        from pagegate.core.seed.simulator import main as simulate

        return simulate(rest) or 0
    if command in ("version", "--version", "-V"):
        import pagegate

        print(pagegate.__version__)
        return 0
    print(USAGE, end="", file=sys.stdout if command in ("-h", "--help", "help") else sys.stderr)
    return 0 if command in ("-h", "--help", "help") else 2


if __name__ == "__main__":
    sys.exit(main())
