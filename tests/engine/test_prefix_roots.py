"""A chain's root keeps apart what must never share pages: a salt cannot spell an adapter's identity, the base
model's requests never hit an adapter's pages, and one API key's pages are never another's hits."""

from __future__ import annotations

import pytest

from pagegate import LLM, SamplingParams
from pagegate.engine.lora import LoRARequest
from pagegate.testing.lora import save_random_adapter

peft = pytest.importorskip("peft")

PROMPT = list(range(30, 70))  # 40 tokens: two whole pages
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def llm_with_adapter(llama_model, tmp_path_factory) -> tuple[LLM, LoRARequest]:
    folder = tmp_path_factory.mktemp("lora_evil")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    save_random_adapter(llama_model.hf_model, folder, config, seed=7, scale=0.3)
    llm = LLM(str(llama_model.path), device="cpu", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    return llm, LoRARequest("evil", 1, str(folder))


def cached(llm: LLM, salt: str | None = None, lora: LoRARequest | None = None) -> int:
    prompt = {"prompt_token_ids": PROMPT, **({"cache_salt": salt} if salt is not None else {})}
    return llm.generate([prompt], ONE, use_tqdm=False, lora_request=lora)[0].num_cached_tokens


def test_a_salt_that_spells_an_adapter_never_hits_its_pages(llm_with_adapter):
    llm, evil = llm_with_adapter
    assert cached(llm, "s", evil) == 0
    assert cached(llm, "s", evil) == 32  # the adapter's own pages are hits for it
    identity = llm.engine.runner.lora.registered["evil"].identity
    # the old root hashed salt + "\0lora:" + identity: this salt was the adapter's chain
    assert cached(llm, f"s\0lora:{identity}") == 0
    assert cached(llm, "s\0") == 0  # and "s" == "s\0"


def test_base_pages_and_adapter_pages_stay_apart(llm_with_adapter):
    llm, evil = llm_with_adapter
    llm.engine.scheduler.pool.reset()
    assert cached(llm, lora=evil) == 0
    assert cached(llm) == 0  # a plain request never takes the adapter's pages
    assert cached(llm) == 32
    assert cached(llm, "") == 32  # an empty salt is no salt


def test_a_tenant_roots_its_own_chain(llm_with_adapter):
    llm, _ = llm_with_adapter
    intake = llm.engine.intake
    roots = {intake.make_request(str(i), PROMPT, ONE, cache_salt=salt, tenant=tenant).root_hash
             for i, (salt, tenant) in enumerate([("x", "t"), ("key:t:x", None), (None, "t"), ("t", None),
                                                 (None, None), ("x", "u")])}
    assert len(roots) == 6
