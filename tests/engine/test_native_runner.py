"""The native core (native_runner.py): a GGUF model on a CPU served without torch in the process, computing what the
torch runner's native decoder computes over the same file, token for token and logprob for logprob."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from pagegate.__main__ import gguf_to_read_ahead
from pagegate.config import EngineConfig
from pagegate.engine import native_runner, runners
from pagegate.engine.llm import LLM
from pagegate.engine.loading import read_ahead
from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf
from pagegate.engine.native_runner import NativeRunner, runs_native
from pagegate.engine.sampling.params import SamplingParams

from .conftest import SavedModel, hf, save_hf_model
from .loading.gguf_files import write_gguf

WIDE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)  # K-quants need rows of 256
PROMPTS = [[5, 17, 99, 3], [200, 1, 45, 45, 45, 80, 7, 9, 11, 13, 15], [12], list(range(30, 60))]
QUANTS = {  # each file's types, by checkpoint name: one type, or Q4_K_M's mixes (parts side by side, widened Q8_0)
    "f32": lambda name: Q.F32, "f16": lambda name: Q.F16, "q4_1": lambda name: Q.Q4_1,
    "q4_k+q6_k": lambda name: Q.Q6_K if "v_proj" in name or "down_proj" in name else Q.Q4_K,
    "q5_0+q8_0": lambda name: Q.Q8_0 if "v_proj" in name else Q.Q5_0,
}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_hf_model(tmp_path_factory.mktemp("wide"), hf().LlamaConfig(**WIDE), seed=21)


@pytest.fixture(scope="module")
def wide_qwen2(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    """Biases on q/k/v and a tied embedding."""
    config = hf().Qwen2Config(**{**WIDE, "tie_word_embeddings": True})
    return save_hf_model(tmp_path_factory.mktemp("qwen2"), config, seed=12)


def answers(path: Path, native: bool, monkeypatch: pytest.MonkeyPatch, **pages: object) -> list[tuple]:
    """Greedy tokens with their logprobs, then seeded samples, from an LLM on the native core or the torch runner."""
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(runners, "runs_native", lambda config, elastic=False: False)
        llm = LLM(str(path), num_kv_blocks=64, **pages)
    assert isinstance(llm.engine.runner, NativeRunner) == native
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True, seed=5, n=2)
    found = []
    for params in (greedy, seeded):
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            for choice in output.outputs:
                logprobs = [(p.logprob, sorted(p.top.items())) for p in choice.logprobs or []]
                found.append((choice.token_ids, logprobs))
    llm.shutdown()
    return found


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_native_core_answers_as_the_torch_runner(arch: str, quant: str, wide_llama: SavedModel,
                                                     wide_qwen2: SavedModel, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = (wide_llama if arch == "llama" else wide_qwen2).hf_model
    path = write_gguf(tmp_path / f"{arch}.gguf", model, arch, quant=lambda name, values: QUANTS[quant](name))
    assert answers(path, True, monkeypatch) == answers(path, False, monkeypatch)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int4"])
def test_every_page_format_it_takes_answers_as_the_torch_runner(kv_cache_dtype: str, wide_llama: SavedModel,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "llama.gguf", wide_llama.hf_model, quant=lambda name, values: Q.Q8_0)
    assert answers(path, True, monkeypatch, kv_cache_dtype=kv_cache_dtype) == \
        answers(path, False, monkeypatch, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_its_embeddings_are_the_torch_runners(pooling: str, wide_qwen2: SavedModel, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A generative server answers /v1/embeddings from the hidden states (pooling.py, numpy for both runners)."""
    path = write_gguf(tmp_path / "qwen2.gguf", wide_qwen2.hf_model, "qwen2", quant=lambda name, values: Q.Q8_0)
    found = []
    for native in (True, False):
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(runners, "runs_native", lambda config, elastic=False: False)
            llm = LLM(str(path), num_kv_blocks=64, pooling=pooling)
        assert isinstance(llm.engine.runner, NativeRunner) == native
        found.append([o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)])
    assert found[0] == found[1] and len(found[0][0]) == WIDE["hidden_size"]


def test_what_it_does_not_serve_goes_to_the_torch_runner(wide_llama: SavedModel, tmp_path: Path) -> None:
    path = str(write_gguf(tmp_path / "llama.gguf", wide_llama.hf_model, quant=lambda name, values: Q.Q8_0))
    assert runs_native(EngineConfig(model=path))
    refused = [EngineConfig(model=path, device="cuda"), EngineConfig(model=path, tensor_parallel_size=2),
               EngineConfig(model=path, quantization="none"), EngineConfig(model=path, task="embed"),
               EngineConfig(model=path, dtype="bfloat16"), EngineConfig(model=str(tmp_path))]
    assert not any(runs_native(config) for config in refused)
    assert not runs_native(EngineConfig(model=path), elastic=True)


def test_a_sleeping_native_core_gives_its_pages_back_and_wakes_to_the_same_answers(
        wide_llama: SavedModel, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama.gguf", wide_llama.hf_model, quant=lambda name, values: Q.Q4_1)
    llm = LLM(str(path), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.sleep()
    assert not hasattr(llm.engine.runner, "kv_cache")
    assert llm.wake_up() == 64
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == before
    llm.shutdown()


def test_its_process_imports_torch_only_for_a_request_that_needs_it(wide_llama: SavedModel, tmp_path: Path) -> None:
    """Greedy, seeded and logprob requests run without torch; a penalty imports it (sampling/processors.py)."""
    path = write_gguf(tmp_path / "llama.gguf", wide_llama.hf_model, quant=lambda name, values: Q.Q4_0)
    script = textwrap.dedent(f"""
        import sys
        from pagegate.engine.llm import LLM
        from pagegate.engine.sampling.params import SamplingParams
        llm = LLM({str(path)!r}, num_kv_blocks=32)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)
        llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=3, max_tokens=4), use_tqdm=False)
        print("torch" in sys.modules)
        llm.generate([[1, 2, 3]], SamplingParams(repetition_penalty=1.3, max_tokens=4), use_tqdm=False)
        print("torch" in sys.modules)
    """)
    lines = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert lines[-2:] == ["False", "True"]


def test_a_read_ahead_core_imports_nothing_the_native_core_does_without(wide_llama: SavedModel,
                                                                        tmp_path: Path) -> None:
    """The engine core's process, its read-ahead of a GGUF done, has imported no torch and none of what other paths
    use: the gguf package (and its yaml and sentencepiece), jinja2 (the gateway renders chat templates), llguidance
    (a first grammar imports it), PIL (images), asyncio (the gateway's loop)."""
    path = write_gguf(tmp_path / "llama.gguf", wide_llama.hf_model, quant=lambda name, values: Q.Q4_1)
    unused = ("torch", "gguf", "yaml", "sentencepiece", "jinja2", "llguidance", "PIL", "asyncio")
    script = textwrap.dedent(f"""
        import sys
        import pagegate.engine.serving.core_loop
        from pagegate.engine.loading import read_ahead
        read_ahead.read_ahead({str(path)!r})
        assert read_ahead._read
        print(sorted(name for name in {unused!r} if name in sys.modules))
    """)
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_a_model_read_ahead_is_taken_by_its_runner_and_dropped_by_another(wide_llama: SavedModel,
                                                                          tmp_path: Path) -> None:
    """`pagegate serve`'s first core reads the GGUF its arguments name before the spec comes (loading/read_ahead.py),
    its vocabulary handed on first: the runner for that file takes what was read, a runner for anything else drops
    it."""
    path = write_gguf(tmp_path / "llama.gguf", wide_llama.hf_model, quant=lambda name, values: Q.Q4_1)
    sent: list[dict] = []
    read_ahead.read_ahead(str(path), on_vocab=sent.append)
    ahead = read_ahead._read[path.resolve()]
    assert [sorted(vocab) for vocab in sent] == [sorted(k for k in ahead.gguf.metadata if k.startswith("tokenizer."))]
    assert tokenizer_from_gguf(sent[0]).backend_json() == ahead.tokenizer.backend_json()
    config = EngineConfig(model=str(path))  # its tokenizer known before the weights load (EarlyTokenizer)
    assert native_runner.preloaded_tokenizer(config) is ahead.tokenizer
    assert native_runner.preloaded_tokenizer(config, elastic=True) is None  # the torch runner's: it reads its own
    assert native_runner.preloaded_tokenizer(replace(config, model=str(tmp_path / "other.gguf"))) is None
    llm = LLM(str(tmp_path / "." / "llama.gguf"), num_kv_blocks=64)  # the same file, named otherwise
    assert llm.engine.runner.weights is ahead.weights and not read_ahead._read
    read_ahead.read_ahead(str(path))
    LLM(str(path), num_kv_blocks=64, dtype="bfloat16")  # the torch runner's
    assert not read_ahead._read
    read_ahead.read_ahead(str(tmp_path / "missing.gguf"))  # a wrong guess: nothing read, the load says why
    assert not read_ahead._read


@pytest.mark.parametrize(("args", "gguf"), [
    (["--model", "a.gguf", "--port", "9"], "a.gguf"), (["--model=A.GGUF"], "A.GGUF"), (["b.gguf", "--port", "9"], "b.gguf"),
    (["--host", "h", "--disable-dashboard", "b.gguf"], "b.gguf"), (["--model", "folder"], None),
    (["--model", "a.gguf", "--model", "b.gguf"], None), ([], None), (["--mmproj", "vision.gguf", "--model", "folder"], None),
    (["--model", "a.gguf", "--lora-modules", "x=adapter.gguf"], "a.gguf")])
def test_the_early_core_reads_thegguf_to_read_ahead_the_arguments_name(args: list[str], gguf: str | None) -> None:
    assert gguf_to_read_ahead(args) == gguf
