"""Gemma 3 and Qwen3 style tokenizers trained here (no hub), saved as Hugging Face folders, and their GGUF
vocabularies written by llama.cpp's own converter.

Plain functions, so any test module can build them in its own session fixtures:

    save_gemma_tokenizer(folder)   # SentencePiece BPE tokenizer.model + tokenizer.json, Gemma 3 chat template
    save_qwen3_tokenizer(folder)   # byte-level BPE tokenizer.json, Qwen3 chat template
    convert_vocab(folder, out, "qwen2")   # needs a config.json in the folder (config.save_pretrained)
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

from bench.peers import llamacpp

GEMMA_VOCAB_SIZE = 1000  # pieces in tokenizer.model, the ids 0..999
GEMMA_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0 1 2 3, as in Gemma
GEMMA_CONTROL = ("<mask>",)  # id 4, as in Gemma
GEMMA_TURNS = ("<start_of_turn>", "<end_of_turn>")  # ids 5 6 (105 106 in Gemma)

QWEN3_BPE_SIZE = 1000  # byte-level tokens and merges, ids 0..999; the added tokens follow, as in Qwen
QWEN3_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # control tokens
QWEN3_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def family_corpus() -> list[str]:
    """A few thousand varied lines: prose, made-up words, numbers, code, chat turns, CJK, emoji, accents."""
    rng = random.Random(0)
    syllables = "ka lo mi ne su ra te vo chi ban dor el ing tion pre str ow th er an qu ix".split()
    words = ("the quick brown fox jumps over lazy dog paged attention cache block token model server user "
             "request stream batch memory page table sequence kernel I'm it's they'll we've don't you're "
             "Hello World MIXED Case café naïve façade résumé über Straße déjà vu").split()
    words += ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(300)]
    words += [word.capitalize() for word in words[::5]] + [word.upper() for word in words[::11]]
    other = ["你好，世界。", "今天天气很好。", "日本語のテキストです。", "한국어 문장도 있습니다.", "Привет, мир!",
             "Γειά σου Κόσμε", "😀", "🎉👍", "🚀", "❤️", "½", "—", "“quotes”", "‘single’", "…"]
    code = ["def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
            "if a->b && !c: print('ok')  # done", "<div class=\"x\">hi</div>", "x = {'a': [1, 2]}",
            "SELECT * FROM t WHERE id = 42;", "    indented\n        deeper\n\n\n", "#!/bin/bash\necho $HOME"]
    lines = []
    for _ in range(3000):
        parts = [rng.choice(words) if rng.random() < 0.8 else
                 rng.choice(other) if rng.random() < 0.6 else str(rng.randint(0, 10 ** rng.randint(1, 7)))
                 for _ in range(rng.randint(3, 14))]
        line = rng.choice([" ", "  ", " ", ", ", "\t", " "]).join(parts) + rng.choice([".", "!", "?", "", "\n"])
        lines.append(line if rng.random() < 0.85 else rng.choice(code))
    return lines


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _added_token(content: str, special: bool) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


# ----------------------------------------------------------------------------------------------------
# Gemma


def _train_gemma_sentencepiece() -> bytes:
    """A SentencePiece BPE model set up as Gemma's: byte fallback, no dummy prefix, digits split, spaces
    kept as they are (identity normalization, whitespace-only pieces), pad/eos/bos/unk at 0-3."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(family_corpus()), model_writer=model, model_type="bpe",
        vocab_size=GEMMA_VOCAB_SIZE, byte_fallback=True, add_dummy_prefix=False, split_digits=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", allow_whitespace_only_pieces=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", control_symbols=list(GEMMA_CONTROL), user_defined_symbols=list(GEMMA_TURNS),
        character_coverage=0.9995, max_sentence_length=1 << 16, minloglevel=2)
    return model.getvalue()


def _gemma_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json as Gemma 3's: every special and turn token special, BOS added, the template."""
    names = (*GEMMA_SPECIAL, *GEMMA_CONTROL, *GEMMA_TURNS)
    return {"tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": False,
            "added_tokens_decoder": {str(i): _added_token(name, True) for i, name in enumerate(names)},
            "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "mask_token": "<mask>", "additional_special_tokens": list(GEMMA_TURNS),
            "clean_up_tokenization_spaces": False, "spaces_between_special_tokens": False,
            "model_max_length": 131072, "padding_side": "left", "sp_model_kwargs": {},
            "use_default_system_prompt": False, "chat_template": GEMMA3_CHAT_TEMPLATE}


def save_gemma_tokenizer(folder: Path) -> None:
    """A Gemma 3 style tokenizer in `folder`: tokenizer.model, the tokenizer.json transformers converts it
    to, tokenizer_config.json with the chat template, and generation_config.json ending on <end_of_turn>."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").unlink(missing_ok=True)  # else transformers would load it, not convert
    (folder / "tokenizer.model").write_bytes(_train_gemma_sentencepiece())
    _write_json(folder / "tokenizer_config.json", _gemma_tokenizer_config())
    converted = AutoTokenizer.from_pretrained(folder)  # no tokenizer.json yet: transformers converts
    converted.backend_tokenizer.save(str(folder / "tokenizer.json"))
    end_of_turn = converted.convert_tokens_to_ids("<end_of_turn>")
    _write_json(folder / "generation_config.json", {"bos_token_id": 2, "eos_token_id": [1, end_of_turn],
                                                    "pad_token_id": 0, "do_sample": True, "top_k": 64,
                                                    "top_p": 0.95})


# ----------------------------------------------------------------------------------------------------
# Qwen3


def _qwen3_backend() -> Any:
    """Qwen2/3's tokenizer.json pipeline (NFC, the Qwen2 split regex, byte-level), trained here."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=QWEN3_BPE_SIZE, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(family_corpus(), trainer)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED])
    return backend


def _qwen3_tokenizer_config(ids: dict[str, int]) -> dict[str, Any]:
    """tokenizer_config.json as Qwen3's: no BOS, eos <|im_end|>, pad <|endoftext|>."""
    decoder = {str(i): _added_token(token, token in QWEN3_SPECIAL) for token, i in ids.items()}
    return {"tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": decoder, "additional_special_tokens": list(QWEN3_SPECIAL[1:]),
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
            "errors": "replace", "clean_up_tokenization_spaces": False, "split_special_tokens": False,
            "model_max_length": 131072}


def save_qwen3_tokenizer(folder: Path) -> None:
    """A Qwen3 style tokenizer in `folder`: tokenizer.json, tokenizer_config.json, chat_template.jinja (as
    transformers 5 saves it), and generation_config.json ending on <|im_end|> or <|endoftext|>."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = _qwen3_backend()
    backend.save(str(folder / "tokenizer.json"))
    ids = {token: backend.token_to_id(token) for token in (*QWEN3_SPECIAL, *QWEN3_ADDED)}
    assert ids["<|endoftext|>"] == QWEN3_BPE_SIZE, ids
    _write_json(folder / "tokenizer_config.json", _qwen3_tokenizer_config(ids))
    (folder / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    _write_json(folder / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.6, "top_k": 20,
        "top_p": 0.95})


# ----------------------------------------------------------------------------------------------------
# GGUF


def convert_vocab(folder: Path, out: Path, pre: str = "") -> Path:
    """The folder's tokenizer as a vocabulary-only GGUF at `out`, by llama.cpp's `convert_hf_to_gguf.py
    --vocab-only` (once). `pre` answers the converter's BPE pre-tokenizer lookup ("qwen2"); the folder
    needs a config.json naming the architecture (a transformers config's save_pretrained)."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; the converter picks its model class from it")
    return llamacpp.convert(folder, out, pre=pre, extra_args=("--vocab-only",))
