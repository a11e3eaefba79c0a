"""The frames between gateway and engine core: per-step deltas, through the wire, add up to exactly the
cumulative outputs the engine builds itself; sampling parameters, errors and counts survive the wire; a frame of
the wrong direction or shape is refused."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagegate import LLM, SamplingParams
from pagegate.engine.errors import InvalidParamError, RequestFailedError
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pins import Pin
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.serving.frames import (
    Abort,
    CoreLoad,
    DeltaWriter,
    FrameReader,
    Outputs,
    Shutdown,
    ToCore,
    ToGateway,
    WireError,
    add_frame,
    framed,
)


def through_the_wire(frame, kinds):
    data = framed(frame)
    reader = FrameReader(kinds)
    return (reader.feed(data[:3]) + reader.feed(data[3:]))[0]  # a frame may arrive in pieces


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
    joined: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        moved = engine.step_requests()
        frame = through_the_wire(Outputs([writer.delta(r) for r in moved], [1, 2]), ToGateway)
        for request, delta in zip(moved, frame.deltas, strict=True):
            output = delta.output(request.prompt, list(request.prompt_token_ids))
            if request.request_id in joined:
                joined[request.request_id].add(output)
            else:
                joined[request.request_id] = output
            expected = request.output()
            if not expected.finished:
                expected = replace(expected, metrics={})  # timings travel once, with the finish
            assert joined[request.request_id] == expected, (request.request_id, steps)
        steps += 1
    assert steps > 5 and set(joined) == set(requests)
    assert writer._sent == {} and writer._scored == set()  # finished requests leave nothing behind
    finished = {name: output.outputs for name, output in joined.items()}
    assert len(finished["choices"]) == 3 and all(len(c.logprobs or []) == 9 for c in finished["choices"])
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
    add = through_the_wire(add_frame("r", None, [1, 2], params, 3, "salt", Pin("key", 5.0)), ToCore)
    back = add.sampling
    assert back == params and back.stop_token_set == params.stop_token_set
    assert (add.request_id, add.token_ids, add.priority, add.cache_salt, add.pin) == ("r", [1, 2], 3, "salt",
                                                                                      Pin("key", 5.0))
    if structured is not None and structured.choice is not None:
        assert list(back.structured_outputs.choice) == list(structured.choice)


def test_errors_keep_their_kind_and_counts_their_fields(engine) -> None:
    def round_trip(error):
        return msgspec.msgpack.decode(msgspec.msgpack.encode(WireError.of(error)), type=WireError).exception()

    invalid = round_trip(InvalidParamError("too long", "max_tokens", "too_long"))
    assert isinstance(invalid, InvalidParamError) and invalid.param == "max_tokens" and invalid.code == "too_long"
    assert isinstance(round_trip("no pages left"), RequestFailedError)
    load = CoreLoad(engine.stats(), engine.health(), 3, 5, 11, 2)
    assert CoreLoad.from_wire(through_the_wire(Outputs([], load.to_wire()), ToGateway).load) == load


def test_a_frame_of_the_other_direction_or_shape_is_refused() -> None:
    assert through_the_wire(Abort("r", 2), ToCore) == Abort("r", 2)
    with pytest.raises(msgspec.ValidationError):
        through_the_wire(Shutdown(), ToGateway)
    with pytest.raises(msgspec.ValidationError):
        FrameReader(ToCore).feed(framed(Outputs([], [])))
