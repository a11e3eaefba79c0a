"""LoRA adapters against transformers + peft: greedy parity for each adapter alone and in one mixed batch with
the base model, over a HF folder and a GGUF base, on both paths (the native decode step with the adapters in its C
table, and torch's hooks); prefix-cache separation; adapter pages, eviction and reload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, EngineConfig, LoRAConfig
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.lora import LoRARequest
from pagegate.engine.lora.model import resolve_adapter
from pagegate.engine.models.native import NativeDecoder
from pagegate.testing.lora import save_random_adapter

from ..conftest import TINY, SavedModel, hf, save_hf_model
from ..loading.gguf_files import write_gguf

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 99, 3], [200, 1, 45, 45, 45, 80, 7, 9, 11, 13, 15], [12], list(range(30, 70))]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (target modules, rank, alpha, rsLoRA)
SPECS = {"attn": (["q_proj", "v_proj"], 4, 8, False), "mlp": (["gate_proj", "up_proj", "down_proj"], 8, 16, True),
         "all": (ALL, 2, 4, False)}


@dataclass
class Adapter:
    request: LoRARequest
    model: torch.nn.Module  # the peft model: the base with this adapter, float32, eval mode


def make_adapter(base: torch.nn.Module, folder: Path, targets: list[str], rank: int, alpha: int, rslora: bool,
                 seed: int) -> torch.nn.Module:
    """A PEFT LoRA over a copy of `base` with random non-zero A and B, saved into `folder`."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    return save_random_adapter(base, folder, config, seed, scale=0.3)


@pytest.fixture(scope="module")
def adapters(llama_model: SavedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    out = {}
    for i, (name, (targets, rank, alpha, rslora)) in enumerate(SPECS.items()):
        folder = tmp_path_factory.mktemp(f"lora_{name}")
        model = make_adapter(llama_model.hf_model, folder, targets, rank, alpha, rslora, seed=100 + i)
        out[name] = Adapter(LoRARequest(name, i + 1, str(folder)), model)
    return out


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(llama_model: SavedModel, adapters: dict[str, Adapter]) -> dict[str | None, list[list[int]]]:
    refs: dict[str | None, list[list[int]]] = {None: [hf_greedy(llama_model.hf_model, p) for p in PROMPTS]}
    refs.update({name: [hf_greedy(a.model, p) for p in PROMPTS] for name, a in adapters.items()})
    assert all(refs[name] != refs[None] for name in adapters)  # each adapter changes the answers
    return refs


# "native": decode steps on the native decoder in exact mode (the torch path's arithmetic), the adapters in its C
# table (the torch forward of prefills adds them with the same C); "torch": the reference backend, torch ops only
PATHS = ["native", "torch"]


def lora_llm(model: str | Path, path: str = "torch", **kwargs: object) -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEGATE_KERNEL_BACKEND", "reference" if path == "torch" else "auto")
        # float32 pages by name: held to PEFT's float32 answers (CPU's default is int8)
        llm = LLM(str(model), device="cpu", enable_lora=True, max_lora_rank=8,
                  **{"num_kv_blocks": 64, "kv_cache_dtype": "float32", **kwargs})
    runner = llm.engine.runner
    assert (runner.native is None) == (runner.lora.table is None) == (path == "torch")
    if path == "native":
        runner.native = NativeDecoder(runner.model, runner.kv_cache, exact=True)
    return llm


def ran_native_with_adapters(llm: LLM) -> bool:
    """Whether the last step ran on the native decoder with adapter rows (the torch path has no native decoder)."""
    native = llm.engine.runner.native
    return native is not None and native.adapters is not None


def tokens(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]


@pytest.mark.parametrize("path", PATHS)
def test_each_adapter_alone_matches_peft(llama_model, adapters, references, path):
    llm = lora_llm(llama_model.path, path)
    for name, adapter in adapters.items():
        assert tokens(llm, PROMPTS, [adapter.request] * len(PROMPTS)) == references[name], name
        assert ran_native_with_adapters(llm) == (path == "native")
    assert tokens(llm, PROMPTS, [None] * len(PROMPTS)) == references[None]
    assert llm.stats().used_blocks == llm.engine.scheduler.adapters.num_pages > 0  # idle adapters stay loaded


@pytest.mark.parametrize("path", PATHS)
def test_one_mixed_batch_serves_every_adapter_and_the_base(llama_model, adapters, references, path):
    names: list[str | None] = [None, *adapters]
    plan = [(p, names[(i + j) % len(names)]) for i, p in enumerate(PROMPTS) for j in range(len(names))]
    llm = lora_llm(llama_model.path, path)
    got = tokens(llm, [p for p, _ in plan], [adapters[n].request if n else None for _, n in plan])
    assert got == [references[n][PROMPTS.index(p)] for p, n in plan]
    assert ran_native_with_adapters(llm) == (path == "native")  # 16 rows: the last steps fit the native decoder


@pytest.mark.parametrize("path", PATHS)
def test_a_batch_past_the_native_step_takes_the_torch_forward_with_its_adapters(llama_model, adapters, references,
                                                                                path):
    """More rows than the native decoder takes (its MAX_TOKENS): torch's hooks add every adapter's update."""
    names: list[str | None] = [None, *adapters]
    plan = [(p, names[(i + j) % len(names)]) for i, p in enumerate(PROMPTS) for j in range(2 * len(names))]
    llm = lora_llm(llama_model.path, path)
    got = tokens(llm, [p for p, _ in plan], [adapters[n].request if n else None for _, n in plan])
    assert got == [references[n][PROMPTS.index(p)] for p, n in plan]


@pytest.mark.parametrize("path", PATHS)
def test_a_gguf_base_takes_the_same_adapters(llama_model, adapters, references, tmp_path, path):
    llm = lora_llm(write_gguf(tmp_path / "model.gguf", llama_model.hf_model, "llama"), path)
    for name in ("attn", "all"):
        assert tokens(llm, PROMPTS, [adapters[name].request] * len(PROMPTS)) == references[name], name


@pytest.mark.parametrize("path", PATHS)
def test_a_page_computed_under_one_adapter_is_never_a_hit_for_another(llama_model, adapters, references, path):
    llm = lora_llm(llama_model.path, path)
    prompt, index = PROMPTS[3], 3  # 40 tokens: two whole pages to share
    order: list[str | None] = [None, "attn", "mlp", "attn", None]
    outputs = [llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[n].request if n else None)[0]
               for n in order]
    assert [o.outputs[0].token_ids for o in outputs] == [references[n][index] for n in order]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 0, 32, 32]


def test_idle_adapters_give_their_pages_back_and_reload(llama_model, adapters, references):
    llm = lora_llm(llama_model.path, max_loras=1)
    pages = llm.engine.scheduler.adapters
    for name in ("attn", "mlp", "attn"):  # max_loras=1: each one evicts the last
        assert tokens(llm, PROMPTS[:2], [adapters[name].request] * 2) == references[name][:2]
        assert list(pages.resident) == [name]
    assert pages.loads == 3
    # a pool that needs every page takes them from the idle adapter, which is read again on demand
    tight = lora_llm(llama_model.path, num_kv_blocks=6, max_model_len=96, enable_prefix_caching=False)
    pages = tight.engine.scheduler.adapters
    assert tokens(tight, [PROMPTS[0]], [adapters["all"].request]) == [references["all"][0]]
    assert pages.num_pages > 0
    long_prompt = list(range(3, 3 + 96 - MAX_TOKENS))  # 6 pages with its answer
    tight.generate([long_prompt], GREEDY, use_tqdm=False)
    assert pages.num_pages == 0 and pages.loads == 1
    assert tokens(tight, [PROMPTS[0]], [adapters["all"].request]) == [references["all"][0]]
    assert pages.loads == 2
    metrics, labels = tight.engine.metrics.registry, {"model_name": tight.engine.model_name}
    assert tight.stats().lora_blocks == pages.num_pages > 0
    assert metrics.get_sample_value("pagegate:lora_adapter_blocks", labels) == pages.num_pages
    assert metrics.get_sample_value("pagegate:lora_adapter_loads_total", labels) == 2


@pytest.mark.parametrize("path", PATHS)
def test_choices_and_guessed_tokens_keep_the_adapter(llama_model, adapters, references, path):
    request = adapters["mlp"].request
    llm = lora_llm(llama_model.path, path)
    [two] = llm.generate(PROMPTS[1], SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False, lora_request=request)
    assert [c.token_ids for c in two.outputs] == [references["mlp"][1]] * 2
    guessing = lora_llm(llama_model.path, path, speculative_config={"method": "ngram", "prompt_lookup_min": 1})
    assert tokens(guessing, PROMPTS, [request] * len(PROMPTS)) == references["mlp"]
    assert guessing.stats().spec_draft_tokens > 0


def test_adapters_that_do_not_fit_are_refused_by_name_and_take_no_pages(llama_model, adapters, tmp_path):
    llm = lora_llm(llama_model.path)
    big = make_adapter(llama_model.hf_model, tmp_path / "big", ["q_proj"], 16, 16, False, seed=1)
    head = make_adapter(llama_model.hf_model, tmp_path / "head", ["lm_head"], 2, 2, False, seed=2)
    wide_config = hf().LlamaConfig(**{**TINY, "hidden_size": 128}, bos_token_id=1, eos_token_id=2)
    other = save_hf_model(tmp_path / "wide", wide_config, seed=3)
    make_adapter(other.hf_model, tmp_path / "wide_lora", ["v_proj"], 2, 2, False, seed=4)
    (tmp_path / "empty").mkdir()
    cases = {"big": "rank 16, more than --max-lora-rank 8", "head": "lm_head", "wide_lora": "lora_A (2, 128)",
             "empty": "no adapter_config.json"}
    for i, (folder, reason) in enumerate(cases.items()):
        with pytest.raises(InvalidParamError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=LoRARequest(folder, 50 + i,
                                                                                       str(tmp_path / folder)))
    assert llm.stats().used_blocks == 0 and not llm.engine.runner.lora.registered
    with pytest.raises(InvalidParamError) as unknown:
        resolve_adapter(llm.engine.runner.lora, "nobody")
    assert unknown.value.code == "model_not_found"
    del big, head



def test_adapters_named_at_start_serve_by_name_and_unload_only_when_unused(llama_model, adapters, references):
    modules = tuple((name, a.request.lora_path) for name, a in adapters.items())
    llm = LLM.from_config(EngineConfig(str(llama_model.path), device="cpu",
                                       cache=CacheConfig(num_kv_blocks=64, kv_cache_dtype="float32"),  # as PEFT's
                                       lora=LoRAConfig(max_lora_rank=8, modules=modules)))
    engine, lora = llm.engine, llm.engine.runner.lora
    assert [r.request.lora_int_id for r in lora.registered.values()] == [1, 2, 3] and lora.next_id == 4
    request = engine.intake.make_request("by-name", PROMPTS[1], GREEDY, lora=resolve_adapter(lora, "mlp"))
    engine.add(request)
    with pytest.raises(ValueError, match="waiting"):
        engine.scheduler.unload_adapter("mlp")
    engine.step()
    with pytest.raises(ValueError, match="running"):
        engine.scheduler.unload_adapter("mlp")
    while engine.has_unfinished():
        engine.step()
    assert request.seqs[0].output_token_ids == references["mlp"][1]
    engine.scheduler.unload_adapter("mlp")
    lora.unregister("mlp")
    engine.refresh_stats()
    assert llm.stats().used_blocks == 0
    with pytest.raises(InvalidParamError, match="does not exist"):
        resolve_adapter(lora, "mlp")
