"""The frames between gateway and engine core: per-step deltas, through the wire, add up to exactly the
cumulative outputs the engine builds itself; every payload (sampling parameters, timings, the tokenizer, counts,
calls' arguments, results and errors) survives the wire typed; a frame of the wrong direction or shape is refused."""

from __future__ import annotations

import socket
from dataclasses import fields, replace

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from pagegate import LLM, SamplingParams
from pagegate.engine.errors import InvalidParamError, RequestFailedError
from pagegate.engine.loading.gguf_file import GGUFFile
from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf, vocabulary
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.outputs import RequestOutput
from pagegate.engine.pin import Pin
from pagegate.engine.pool_snapshot import take_snapshot
from pagegate.engine.sampling.structured import StructuredOutputsParams
from pagegate.engine.serving.core_loop import CoreLoop
from pagegate.engine.serving.frames import (
    Abort,
    Call,
    CallError,
    CoreLoad,
    DeltaWriter,
    EarlyTokenizer,
    FrameReader,
    Outputs,
    Ready,
    Reply,
    RequestDelta,
    Shutdown,
    ToCore,
    ToGateway,
    WireError,
    WireSampling,
    WireSnapshot,
    WireStructured,
    WireTimings,
    WireTokenizer,
    add_frame,
    framed,
)
from pagegate.engine.tenants import BATCH, ONLINE, KeyShare


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
        frame = through_the_wire(Outputs([writer.delta(r) for r in moved], load_of(engine)), ToGateway)
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


STRUCTURED = st.sampled_from([StructuredOutputsParams(choice=["yes", "no"]),
                              StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, 2.5]}}}),
                              StructuredOutputsParams(json='{"type": "string"}'),
                              StructuredOutputsParams(regex="[a-z]+"), StructuredOutputsParams(grammar="start: 'a'"),
                              StructuredOutputsParams(json_object=True)])


@given(n=st.integers(1, 4), temperature=st.integers(0, 2) | st.floats(0, 2), top_k=st.sampled_from([-1, 0, 40]),
       seed=st.none() | st.integers(0, 2**63 - 1), max_tokens=st.none() | st.integers(20, 100),
       stop=st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=3),
       stop_token_ids=st.lists(st.integers(0, 1000), max_size=4),
       bias=st.dictionaries(st.integers(0, 1000), st.floats(-100, 100) | st.integers(-100, 100), max_size=3),
       logprobs=st.none() | st.integers(0, 5), flags=st.lists(st.booleans(), min_size=3, max_size=3),
       structured=st.none() | STRUCTURED, after=st.none() | st.integers(0, 1000))
def test_sampling_params_survive_the_wire(n, temperature, top_k, seed, max_tokens, stop, stop_token_ids, bias, logprobs,
                                          flags, structured, after) -> None:
    params = SamplingParams(n=n, temperature=temperature, top_k=top_k, seed=seed, max_tokens=max_tokens, stop=stop,
                            stop_token_ids=stop_token_ids, logit_bias=bias or None, logprobs=logprobs,
                            prompt_logprobs=logprobs, include_stop_str_in_output=flags[0], ignore_eos=flags[1],
                            skip_special_tokens=flags[2], structured_outputs=structured, grammar_after_token=after)
    pins = (Pin("key", 5.0), Pin("prefix", 300.0, 48))
    add = through_the_wire(add_frame("r", None, [1, 2], params, 3, "salt", pins), ToCore)
    back = add.sampling
    assert back == params and back.stop_token_set == params.stop_token_set == frozenset(stop_token_ids)
    assert (add.request_id, add.token_ids, add.priority, add.cache_salt, add.pins) == ("r", [1, 2], 3, "salt",
                                                                                       list(pins))


def test_a_choice_tuple_arrives_as_its_list() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes", "no")))
    back = through_the_wire(add_frame("r", None, [1], params), ToCore).sampling
    assert back.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])


def test_a_whole_float_crosses_as_its_int_and_a_wrong_type_fails_before_the_wire() -> None:
    params = SamplingParams(top_k=20.0, max_tokens=8.0)  # as generation_config.json defaults can come
    back = through_the_wire(add_frame("r", None, [1], params), ToCore).sampling
    assert (back.top_k, back.max_tokens) == (20, 8) and type(back.top_k) is int
    with pytest.raises(msgspec.ValidationError):
        add_frame("r", None, [1], SamplingParams(max_tokens=8.5))


def test_the_wire_mirrors_of_the_sampling_parameters_have_their_fields_in_order() -> None:
    assert WireSampling.__struct_fields__ == tuple(f.name for f in fields(SamplingParams) if f.init)
    assert WireStructured.__struct_fields__ == tuple(f.name for f in fields(StructuredOutputsParams))


def test_bad_sampling_parameters_decode_and_fail_when_the_core_reads_them() -> None:
    params = SamplingParams()
    params.max_tokens = 0  # set after the checks, as a client could
    add = through_the_wire(add_frame("r", None, [1], params), ToCore)
    with pytest.raises(InvalidParamError, match="max_tokens"):
        _ = add.sampling


def load_of(engine, *counts: int) -> CoreLoad:
    return CoreLoad(engine.stats(), engine.health(), *counts)


def test_errors_keep_their_kind_and_counts_their_fields(engine) -> None:
    def round_trip(error):
        return msgspec.msgpack.decode(msgspec.msgpack.encode(WireError.of(error)), type=WireError).exception()

    invalid = round_trip(InvalidParamError("too long", "max_tokens", "too_long"))
    assert isinstance(invalid, InvalidParamError) and invalid.param == "max_tokens" and invalid.code == "too_long"
    assert isinstance(round_trip("no pages left"), RequestFailedError)
    load = load_of(engine, 3, 5, 11, 2)
    assert through_the_wire(Outputs([], load), ToGateway).load == load
    assert isinstance(load.stats.spec_accepted_per_position, tuple)


def test_timings_cross_as_the_request_wrote_them(engine) -> None:
    timings = {"arrival_time": 1.5, "first_scheduled_time": 1.75, "prefix_hit_pages": 2, "pages_held": 4,
               "preemptions": [["swap", 2.0, 3, 0, 2.5], ["recompute", 3.0, 1, 1, None]]}
    for sent in (timings, {"arrival_time": 1.5, "prefix_hit_pages": 0, "pages_held": 0}):
        outputs = Outputs([RequestDelta("r", True, timings=WireTimings(**sent))], load_of(engine))
        delta = through_the_wire(outputs, ToGateway).deltas[0]
        assert delta.output(None, []).metrics == sent


def test_the_tokenizer_is_rebuilt_in_the_gateway(engine) -> None:
    backend = HFTokenizer(WordLevel({"a": 0, "b": 1, "<unk>": 2, "</s>": 3}, unk_token="<unk>"))
    tokenizer = Tokenizer(backend, {"eos_token": {"content": "</s>"}, "unk_token": "<unk>"}, "{{ messages }}", [1])
    ready = Ready("m", 128, "fp16", 4, [3], {"temperature": 0.6, "top_k": 20}, WireTokenizer.of(tokenizer), load_of(engine))
    back = through_the_wire(ready, ToGateway)
    assert back == ready and type(back.default_sampling["top_k"]) is int
    rebuilt = back.tokenizer.tokenizer()
    assert (rebuilt.special_tokens, rebuilt.chat_template, rebuilt.eos_token_ids, rebuilt.backend_json()) == (
        tokenizer.special_tokens, tokenizer.chat_template, tokenizer.eos_token_ids, tokenizer.backend_json())
    assert through_the_wire(msgspec.structs.replace(ready, tokenizer=None), ToGateway).tokenizer is None
    assert not back.one_path and through_the_wire(msgspec.structs.replace(ready, one_path=True), ToGateway).one_path


def test_a_gguf_vocabulary_sent_early_builds_the_tokenizer_the_core_builds(smollm2_gguf) -> None:
    """A read-ahead core sends its GGUF's vocabulary before its weights load (EarlyTokenizer): the gateway's copy
    built from it is the core's, ids, texts, template and end tokens alike."""
    metadata = GGUFFile(smollm2_gguf).metadata
    mine = tokenizer_from_gguf(metadata)
    early = through_the_wire(EarlyTokenizer(vocabulary(metadata)), ToGateway)
    theirs = tokenizer_from_gguf(early.vocabulary)
    assert theirs.backend_json() == mine.backend_json()
    assert (theirs.special_tokens, theirs.chat_template, theirs.eos_token_ids) == (
        mine.special_tokens, mine.chat_template, mine.eos_token_ids)
    text = "Hello, wörld! 123 <|im_start|>"
    assert theirs.encode(text) == mine.encode(text)


@pytest.mark.parametrize("arg", [None, 7, "adapter", ("adapter", "/path/to/it")])
def test_call_arguments_cross_typed(arg) -> None:
    assert through_the_wire(Call(4, "wake", arg), ToCore) == Call(4, "wake", arg)


@pytest.mark.parametrize("result", [None, 12, b"# HELP metrics\n"])
def test_call_results_and_errors_cross_typed(result) -> None:
    assert through_the_wire(Reply(2, result), ToGateway) == Reply(2, result)
    error = through_the_wire(Reply(3, error=CallError.of(ValueError("in use"))), ToGateway).error
    assert error == CallError("ValueError", "in use")
    raised = error.exception()
    assert type(raised) is RuntimeError and str(raised) == "ValueError: in use"


def test_a_pool_snapshot_crosses_whole(engine) -> None:
    request = engine.add_request("snap", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step_requests()
    sent = take_snapshot(engine)
    engine.abort(request.request_id)
    reply = through_the_wire(Reply(0, WireSnapshot.of(sent)), ToGateway)
    back = reply.result.snapshot()
    assert np.array_equal(back.device_states, sent.device_states) and np.array_equal(back.cpu_states, sent.cpu_states)
    assert (back.taken_at, back.stats, back.health, back.health_reason) == (sent.taken_at, sent.stats, sent.health,
                                                                            sent.health_reason)
    assert {q: [(rid, list(p)) for rid, p in e] for q, e in back.seq_pages.items()} == {
        q: [(rid, list(p)) for rid, p in e] for q, e in sent.seq_pages.items()}
    assert any(rid == "snap" for rid, _ in back.seq_pages["running"])


def test_a_frame_of_the_other_direction_or_shape_is_refused(engine) -> None:
    assert through_the_wire(Abort("r", 2), ToCore) == Abort("r", 2)
    with pytest.raises(msgspec.ValidationError):
        through_the_wire(Shutdown(), ToGateway)
    with pytest.raises(msgspec.ValidationError):
        FrameReader(ToCore).feed(framed(Outputs([], load_of(engine))))
    with pytest.raises(msgspec.ValidationError):
        FrameReader(ToCore).feed(framed(Call(1, "wake", 2.5)))  # no call takes a float


def test_the_lane_and_the_keys_share_reach_the_engines_request(engine) -> None:
    """What the scheduler orders by crosses the seam: a batch request's lane, its key's name, weight and quota."""
    key = KeyShare("team-a", 2.0, 64)
    mine, theirs = socket.socketpair()
    try:
        loop = CoreLoop(engine, mine)
        for request_id, lane, share in (("laned", BATCH, key), ("plain", ONLINE, None)):
            frame = add_frame(request_id, None, [5, 6, 7], SamplingParams(max_tokens=2), lane=lane, key=share)
            loop._handle(through_the_wire(frame, ToCore))
            request = engine.requests[request_id]
            assert (request.lane, request.key) == (lane, share)
            engine.abort(request_id)
        with pytest.raises(msgspec.ValidationError):
            through_the_wire(add_frame("bad", None, [5], SamplingParams(), lane="urgent"), ToCore)  # type: ignore[arg-type]
    finally:
        mine.close()
        theirs.close()
