"""Answers split into reasoning, content and calls: any chunking gives the whole text's split."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.gateway.answer import AnswerSplitter, Reasoning, split_answer
from pagegate.gateway.tools import CallParsing

PIECES = ["<think>", "</think>", "plan", " ", "\n", "<", "</", "think", ">", "answer", "é",
          '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>']


def streamed(text: str, cuts: list[int], calls: CallParsing | None, parser: str | None) -> tuple[str, str, int]:
    splitter = AnswerSplitter(calls, parser)
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    events = [e for a, b in zip(bounds, bounds[1:], strict=False) for e in splitter.feed(text[a:b])]
    events += splitter.finish()
    thought = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e for e in events if isinstance(e, str))
    return thought, content, len(splitter.parsed_calls)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=14), cuts=st.lists(st.integers(0, 400), max_size=8),
       parser=st.sampled_from(["qwen3", "deepseek_r1", None]), tools=st.booleans())
def test_any_chunking_splits_like_the_whole_text(parts: list[str], cuts: list[int], parser: str | None,
                                                 tools: bool) -> None:
    text = "".join(parts)
    calls = CallParsing({"f": {}}) if tools else None
    whole = split_answer(text, calls, parser)
    thought, content, num_calls = streamed(text, cuts, calls, parser)
    assert thought == (whole.reasoning or "")
    assert content == (whole.content or "")
    assert num_calls == len(whole.calls)


def test_qwen3_reasoning_opens_with_the_tag() -> None:
    answer = split_answer("<think>\nLet me see.\n</think>\n\nParis.", None, "qwen3")
    assert (answer.reasoning, answer.content) == ("\nLet me see.\n", "Paris.")
    assert split_answer("Paris.", None, "qwen3").reasoning is None


def test_deepseek_r1_starts_inside_the_block() -> None:
    answer = split_answer("Let me see.</think>Paris.", None, "deepseek_r1")
    assert (answer.reasoning, answer.content) == ("Let me see.", "Paris.")
    unfinished = split_answer("Still thinking", None, "deepseek_r1")
    assert (unfinished.reasoning, unfinished.content) == ("Still thinking", "")


def test_calls_are_read_from_the_answer_not_the_reasoning() -> None:
    block = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    answer = split_answer(f"<think>maybe {block}</think>{block}", CallParsing({"f": {}}), "qwen3")
    assert answer.reasoning == f"maybe {block}"
    assert len(answer.calls) == 1 and answer.content is None
