"""The frames between gateway and engine core: per-step deltas, packed and unpacked, add up to exactly the
cumulative outputs the engine builds itself; sampling parameters survive the wire."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagegate import LLM, SamplingParams
from pagegate.engine.errors import InvalidParamError, RequestFailedError
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.serving.frames import (
    CoreLoad,
    DeltaWriter,
    OutputAssembler,
    error_from_wire,
    error_to_wire,
    pack,
    params_from_wire,
    params_to_wire,
    unpack,
)


@pytest.fixture(scope="module")
def engine():
    llm = LLM(None, device="cpu", num_kv_blocks=256, seed=0)
    yield llm.engine
    llm.shutdown()


PARAMS = {
    "plain": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "choices": SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=9, logprobs=2, ignore_eos=True),
    "stopped": SamplingParams(temperature=0, max_tokens=30, stop=[" the", "e"], ignore_eos=True),
    "kept stop": SamplingParams(temperature=0, max_tokens=30, stop=["e"], include_stop_str_in_output=True),
}


def test_deltas_rebuild_the_engines_cumulative_outputs_at_every_step(engine) -> None:
    requests = {name: engine.add_request(name, "Once upon a time there", params) for name, params in PARAMS.items()}
    writer = DeltaWriter()
    assemblers = {name: OutputAssembler(name, r.prompt, list(r.prompt_token_ids)) for name, r in requests.items()}
    steps = 0
    while engine.has_unfinished():
        for request in engine.step_requests():
            rebuilt = assemblers[request.request_id].apply(unpack(pack(writer.delta(request))))
            expected = request.output()
            if not expected.finished:
                expected = replace(expected, metrics={})  # timings travel once, with the finish
            assert rebuilt == expected, (request.request_id, steps)
        steps += 1
    assert steps > 5
    assert writer._sent == {}  # finished requests leave nothing behind
    finished = {name: a.choices for name, a in assemblers.items()}
    assert len(finished["choices"]) == 3 and all(len(c.logprobs or []) == 9 for c in finished["choices"].values())
    assert finished["kept stop"][0].stop_reason == "e" and finished["kept stop"][0].text.endswith("e")
    assert finished["stopped"][0].finish_reason == "stop" and "e" not in finished["stopped"][0].text


def test_an_aborted_request_is_forgotten(engine) -> None:
    request = engine.add_request("gone", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    writer = DeltaWriter()
    engine.step_requests()
    writer.delta(request)
    engine.abort("gone")
    writer.forget("gone")
    assert writer._sent == {}


@given(n=st.integers(1, 4), temperature=st.floats(0, 2), stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
       bias=st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
       logprobs=st.none() | st.integers(0, 5),
       structured=st.none() | st.sampled_from([StructuredOutputsParams(choice=["yes", "no"]),
                                               StructuredOutputsParams(json={"type": "object"}),
                                               StructuredOutputsParams(regex="[a-z]+")]))
def test_sampling_params_survive_the_wire(n, temperature, stop, bias, logprobs, structured) -> None:
    params = SamplingParams(n=n, temperature=temperature, stop=stop, logit_bias=bias or None, logprobs=logprobs,
                            structured_outputs=structured, stop_token_ids=[3, 4])
    back = params_from_wire(unpack(pack([params_to_wire(params)]))[0])
    assert back == params and back.stop_token_set == params.stop_token_set
    if structured is not None and structured.choice is not None:
        assert list(back.structured_outputs.choice) == list(structured.choice)


def test_errors_keep_their_kind_and_counts_their_fields(engine) -> None:
    invalid = error_from_wire(unpack(pack(error_to_wire(InvalidParamError("too long", "max_tokens", "too_long")))))
    assert isinstance(invalid, InvalidParamError) and invalid.param == "max_tokens" and invalid.code == "too_long"
    assert isinstance(error_from_wire(error_to_wire("no pages left")), RequestFailedError)
    load = CoreLoad(engine.stats(), engine.health(), 3, 5, 11, 2)
    assert CoreLoad.from_wire(unpack(pack(load.to_wire()))) == load
