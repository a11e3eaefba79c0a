"""llama.cpp as a benchmark peer: build its CPU tools from the llama-cpp-python sdist, convert models, run them.

    python -m bench.peers.llamacpp build             # once; later runs find the binaries and return at once
    python -m bench.peers.llamacpp convert FOLDER    # a Hugging Face folder -> FOLDER's name .gguf in the cache

The sdist vendors a full llama.cpp checkout (sources, `convert_hf_to_gguf.py`, `gguf-py`); it comes from the
package index like any dependency, so no git clone and no model hub.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

CACHE = Path(".cache/peers")
SDIST = "llama-cpp-python"
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # the server's web page would be downloaded
)


def source_dir(cache: Path = CACHE) -> Path:
    """The vendored llama.cpp tree, downloaded (sdist only, no wheel) and unpacked the first time."""
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(cache), SDIST], check=True)
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdists[-1]) as archive:
        archive.extractall(cache, filter="data")
    return sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1]


def binary(name: str, cache: Path = CACHE) -> Path:
    return cache / "build" / "bin" / name


def build(cache: Path = CACHE, jobs: int = 2) -> float:
    """Build the CPU tools under `cache/build`; the seconds it took, 0 when they were already there."""
    if all(binary(t, cache).is_file() for t in TARGETS):
        return 0.0
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is missing: apt-get install -y cmake")
    start = time.perf_counter()
    build_dir = cache / "build"
    nice = ["nice", "-n", "19"]
    subprocess.run([*nice, "cmake", "-S", str(source_dir(cache)), "-B", str(build_dir), *CMAKE_FLAGS], check=True)
    subprocess.run([*nice, "cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS], check=True)
    return time.perf_counter() - start


def pre_tokenizer(model_dir: Path) -> str:
    """The llama.cpp pre-tokenizer name for the folder's tokenizer, "" to leave it to the converter's lookup.

    A byte-level BPE that splits with the GPT-2 pattern (the default model's tokenizer) is llama.cpp's "gpt-2";
    the converter would only recognise it by the hash of a published model's tokenizer.
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return ""
    pre = json.loads(path.read_text()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    return ""


def convert(model_dir: Path, out: Path, outtype: str = "f32", cache: Path = CACHE, pre: str | None = None,
            extra_args: tuple[str, ...] = ()) -> Path:
    """`model_dir` (a Hugging Face folder) as a GGUF file at `out`, converted once. `pre` names the BPE
    pre-tokenizer for the converter (default: `pre_tokenizer`'s guess; "" leaves it to its hash lookup)."""
    if out.is_file():
        return out
    source = source_dir(cache)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".part")
    converter = [sys.executable, str(Path(__file__).with_name("convert_gguf.py")), str(source)]
    pre = pre_tokenizer(model_dir) if pre is None else pre
    subprocess.run([*converter, pre, str(model_dir), "--outfile", str(partial), "--outtype", outtype, *extra_args],
                   check=True)
    partial.rename(out)
    return out


def quantize(source: Path, out: Path, kind: str = "Q4_K_M") -> Path:
    """`source` requantized to `kind` by llama.cpp's own llama-quantize (once)."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".part")
    subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(source), str(partial), kind], check=True,
                   capture_output=True)
    partial.rename(out)
    return out


def repack_crashes() -> bool:
    """This llama.cpp's weight repacking crashes on Q4_1 on the Intel Xeons with AMX these benchmarks meet:
    there both tools run with repacking off (llama-bench --repack 0, llama-server --no-repack)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def bench(model: Path, threads: int = 2, prompts: Sequence[int] = (128,), gen: int = 128,
          reps: int = 3) -> dict[str, float]:
    """llama-bench's average tok/s: "prefill<n>" for a prompt of each length in `prompts` (ppN) and "decode" for
    one stream generating `gen` tokens (tgN)."""
    result = subprocess.run([str(binary("llama-bench")), "-m", str(model), "-t", str(threads),
                             "-p", ",".join(map(str, prompts)), "-n", str(gen), "-r", str(reps), "-o", "json",
                             *(["--repack", "0"] if repack_crashes() else [])], check=True, capture_output=True,
                            text=True)
    rows = json.loads(result.stdout)
    figures = {f"prefill{r['n_prompt']}": r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0}
    figures["decode"] = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return figures


def batched(model: Path, sequences: int, prompt: int, gen: int, threads: int = 2) -> float:
    """llama-batched-bench's total tok/s (its S t/s: prompt and generated tokens over the whole run) for
    `sequences` sequences of a `prompt`-token prompt each generating `gen` tokens, all decoded together
    (`-npp prompt -ntg gen -npl sequences`)."""
    result = subprocess.run([str(binary("llama-batched-bench")), "-m", str(model), "-t", str(threads), "-tb",
                             str(threads), "-c", str(sequences * (prompt + gen)), "-b", "2048", "-ub", "512",
                             "-npp", str(prompt), "-ntg", str(gen), "-npl", str(sequences), "--output-format",
                             "jsonl", *(["--no-repack"] if repack_crashes() else [])],
                            check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if not rows:  # it skips a case that does not fit its context
        raise RuntimeError(f"llama-batched-bench measured nothing: {result.stderr[-2000:]}")
    return rows[0]["speed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build")
    conv = sub.add_parser("convert")
    conv.add_argument("folder", type=Path)
    conv.add_argument("--outtype", default="f32")
    args = parser.parse_args()
    if args.command == "build":
        seconds = build()
        print(f"llama.cpp tools in {binary('').parent}: " + (f"built in {seconds:.0f} s" if seconds else "cached"))
    else:
        print(convert(args.folder, CACHE / "gguf" / f"{args.folder.name}.gguf", args.outtype))


if __name__ == "__main__":
    main()
