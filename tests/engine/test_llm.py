"""The offline API against transformers: greedy parity through the whole engine, under page pressure."""

import copy

import pytest
import torch

from pagegate import LLM, SamplingParams

from .conftest import SavedModel, hf

PROMPT_LENGTHS = [5, 17, 16, 33, 1, 48, 9, 70]
MAX_TOKENS = 10


def make_prompts(vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(saved: SavedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = saved.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_all_pages_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.used_blocks == 0 and stats.running == stats.waiting == stats.swapped == 0
    assert stats.cpu_used_blocks == 0


# float32 pages by name (CPU's default is int8): held to transformers' float32 greedy tokens
ENGINE_SETUPS = {
    "roomy": dict(num_kv_blocks=64, kv_cache_dtype="float32"),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=16, kv_cache_dtype="float32"),
    "recompute": dict(num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128, kv_cache_dtype="float32"),
    "swap": dict(num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128, swap_space=0.001,
                 kv_cache_dtype="float32"),
}


@pytest.fixture(scope="module")
def references(request) -> dict:
    return {}


@pytest.mark.parametrize("arch", ["llama_model", "mistral_model", "qwen2_model"])
@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_matches_transformers(arch, setup, request, references):
    saved = request.getfixturevalue(arch)
    prompts = make_prompts()
    if arch not in references:
        references[arch] = [hf_greedy(saved, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(saved.path), device="cpu", **ENGINE_SETUPS[setup])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references[arch]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if setup in ("recompute", "swap"):
        assert llm.stats().preemptions > 0
    if setup == "swap":
        assert llm.stats().swap_in_blocks > 0
    assert_all_pages_free(llm)


def test_prompt_logits_match_transformers(llama_model):
    """Float32 logits of every prompt position within 1e-4 of transformers'."""
    # without prefix caching the first step takes the whole prompt (with it, the prompt stops at a hit's end first)
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, enable_prefix_caching=False,
              kv_cache_dtype="float32")
    engine = llm.engine
    prompt = make_prompts()[5]
    request = engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    runner = engine.runner
    seq = request.seqs[0]
    # every position samples here: ask the model for all rows directly
    block_tables, slots, positions, seq_lens, starts = runner.builder.build([seq.handle], batch.num_tokens)
    from pagegate.engine.models.layers import AttentionMetadata
    attn = AttentionMetadata(*(torch.from_numpy(a) for a in (slots, block_tables, seq_lens, starts)))
    with torch.inference_mode():
        hidden = engine.runner.model(torch.tensor(prompt), torch.from_numpy(positions), engine.runner.kv_cache.layers, attn)
        ours = engine.runner.model.compute_logits(hidden)
        theirs = llama_model.hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    engine.abort("r")
    assert_all_pages_free(llm)


def test_seeded_sampling_is_the_same_whatever_the_batch(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    prompts = make_prompts()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [other] * 3 + [seeded] + [other] * 4, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    assert_all_pages_free(llm)


def test_stop_token_ids_end_the_output(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    prompt = make_prompts()[1]
    free_run = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    stop_at = free_run.token_ids[2]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    first = free_run.token_ids.index(stop_at)
    assert stopped.token_ids == free_run.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert_all_pages_free(llm)


def test_too_long_prompt_is_rejected_with_both_numbers(llama_model):
    from pagegate.engine.errors import InvalidParamError
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidParamError, match="60 in the prompt, 10 for the completion"):
        llm.generate([3] * 60, SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(InvalidParamError):  # the good first prompt is not left queued either
        llm.generate([[3] * 5, [3] * 60], SamplingParams(max_tokens=10), use_tqdm=False)
    assert_all_pages_free(llm)


def test_pool_too_small_for_max_model_len_fails_at_start(llama_model):
    with pytest.raises(ValueError, match="needs 16 pages"):
        LLM(str(llama_model.path), device="cpu", num_kv_blocks=8)


def test_a_max_model_len_past_the_models_positions_fails_at_start(llama_model):
    """Else a prompt past max_position_embeddings would index past the RoPE tables and end the engine."""
    with pytest.raises(ValueError, match="more than the model's 256 positions"):
        LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, max_model_len=512)


def test_the_llm_sleeps_wakes_and_takes_adapters_in_and_out(llama_model, tmp_path):
    from pagegate.engine.errors import InvalidParamError
    from pagegate.engine.lora import LoRARequest
    from pagegate.testing.lora import lora_tensors, write_adapter

    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=32, kv_cache_dtype="float32", enable_lora=True,
              max_lora_rank=4)
    params, prompt = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), make_prompts()[1]

    def tokens(lora: LoRARequest | None = None) -> list[int]:
        return llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids

    base = tokens()
    llm.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        tokens()
    assert llm.wake_up() == 32 and tokens() == base
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    hf_config = llama_model.hf_model.config
    shapes = {"q_proj": (hf_config.hidden_size, hf_config.hidden_size)}
    folder = str(write_adapter(tmp_path / "q", lora_tensors(shapes, hf_config.num_hidden_layers, 4, 1, 0.3), config))
    lora_id = llm.load_lora_adapter("q", folder)
    assert tokens(LoRARequest("q", lora_id, folder)) != base
    llm.unload_lora_adapter("q")
    assert_all_pages_free(llm)
    with pytest.raises(InvalidParamError, match="does not exist"):
        llm.unload_lora_adapter("q")


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_llm(chat_model) -> LLM:
    return LLM(str(chat_model.path), device="cpu", num_kv_blocks=64)


def rest_chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids the REST chat endpoint makes for these messages."""
    from pagegate.gateway.prepare import ModelContext, chat_prompt
    from pagegate.gateway.protocol import ChatMessage

    context = ModelContext(("m",), tokenizer, 256, tokenizer.vocab_size)
    return chat_prompt([ChatMessage(**m) for m in messages], context).token_ids


def test_generate_takes_every_vllm_prompt_shape(chat_llm):
    text = "Paged attention keeps the cache in blocks. " * 3
    ids = chat_llm.get_tokenizer().encode(text)
    shapes = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}, {"prompt_token_ids": ids, "prompt": text}]
    outputs = chat_llm.generate(shapes, SHORT, use_tqdm=False)
    tokens = outputs[0].outputs[0].token_ids
    assert all(o.prompt_token_ids == ids and o.outputs[0].token_ids == tokens for o in outputs)
    assert [o.prompt for o in outputs] == [text, None, text, None, text]
    for shape in shapes[:4]:  # one prompt alone, whatever its shape
        [alone] = chat_llm.generate(shape, SHORT, use_tqdm=False)
        assert alone.outputs[0].token_ids == tokens
    assert outputs[-1].num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0  # full pages from the prefix cache
    salted = chat_llm.generate({"prompt": text, "cache_salt": "tenant"}, SHORT, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0 and salted.outputs[0].token_ids == tokens
    with pytest.raises(ValueError, match="multi_modal_data"):
        chat_llm.generate({"prompt": text, "multi_modal_data": {}}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        chat_llm.generate({"cache_salt": "x"}, use_tqdm=False)
    with pytest.raises(TypeError, match="float"):
        chat_llm.generate([text, 1.5], use_tqdm=False)
    assert_all_pages_free(chat_llm)


def test_chat_prompt_ids_match_transformers_and_the_rest_endpoint(chat_model, chat_llm):
    hf_tokenizer = hf().AutoTokenizer.from_pretrained(chat_model.path)
    theirs = hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
    outputs = chat_llm.chat(CONVERSATION, SHORT, use_tqdm=False)
    assert isinstance(outputs, list) and len(outputs) == 1
    out = outputs[0]
    assert out.prompt_token_ids == theirs == rest_chat_ids(chat_llm.get_tokenizer(), CONVERSATION)
    assert out.prompt_token_ids.count(hf_tokenizer.bos_token_id) == 1  # the template writes it; no second
    assert out.prompt == hf_tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert out.outputs[0].token_ids == chat_llm.generate(theirs, SHORT, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_template_without_bos_gets_the_bos_once_like_the_rest_endpoint(chat_llm):
    tokenizer = chat_llm.get_tokenizer()
    [out] = chat_llm.chat(CONVERSATION, SHORT, use_tqdm=False, chat_template=CHATML)
    assert out.prompt == "<|system|>Be brief.<|end|><|user|>Hello world!<|end|><|assistant|>"
    assert out.prompt_token_ids == [tokenizer.bos_token_id, *tokenizer.encode(out.prompt, add_special_tokens=False)]
    chatml_tokenizer = copy.copy(tokenizer)
    chatml_tokenizer.chat_template = CHATML
    assert out.prompt_token_ids == rest_chat_ids(chatml_tokenizer, CONVERSATION)
    assert tokenizer.chat_template != CHATML  # the override did not stick


def test_chat_takes_a_list_of_conversations_and_of_params(chat_llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]}]
    params = [SHORT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    outputs = chat_llm.chat([CONVERSATION, parts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 2]
    assert outputs[1].prompt == "<|begin|><|user|>Hello world!<|end|><|assistant|>"
    assert outputs[1].prompt_token_ids == rest_chat_ids(chat_llm.get_tokenizer(), parts)
    developer = [{"role": "developer", "content": "Be brief."}, CONVERSATION[1]]
    assert chat_llm.chat(developer, SHORT, use_tqdm=False)[0].prompt_token_ids == outputs[0].prompt_token_ids
    with pytest.raises(ValueError, match="2 prompts but 3"):
        chat_llm.chat([CONVERSATION, parts], [SHORT] * 3, use_tqdm=False)
    assert_all_pages_free(chat_llm)


def test_chat_template_arguments(chat_model, chat_llm):
    def prompt(messages=CONVERSATION, **kwargs) -> str:
        return chat_llm.chat(messages, SHORT, use_tqdm=False, **kwargs)[0].prompt

    with_header = prompt()
    assert with_header.endswith("<|assistant|>")
    assert prompt(add_generation_prompt=False) == with_header.removesuffix("<|assistant|>")
    assert prompt(chat_template_kwargs={"add_generation_prompt": False}) == with_header.removesuffix("<|assistant|>")
    custom = "{{ greeting }}{% for t in tools or [] %}[{{ t['name'] }}]{% endfor %}{{ messages[-1]['content'] }}"
    assert prompt(chat_template=custom, tools=[{"name": "search"}],
                  chat_template_kwargs={"greeting": "Hi: "}) == "Hi: [search]Hello world!"
    partial = [*CONVERSATION, {"role": "assistant", "content": "The answer"}]
    hf_tokenizer = hf().AutoTokenizer.from_pretrained(chat_model.path)
    theirs = hf_tokenizer.apply_chat_template(partial, continue_final_message=True, tokenize=False)
    assert prompt(partial, add_generation_prompt=False, continue_final_message=True) == theirs
    assert theirs.endswith("<|assistant|>The answer")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        chat_llm.chat(partial, continue_final_message=True)
    with pytest.raises(ValueError, match="image_url"):
        chat_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_needs_a_tokenizer(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.chat(CONVERSATION, use_tqdm=False)
