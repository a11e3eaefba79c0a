"""Protobuf messages <-> the plain dicts of the REST API (pagegate.proto's conventions).

Requests: `request_to_body` gives the dict a JSON body would be (only the fields that are set), so the
server validates it with the REST code; `body_to_request` is its inverse, for clients. Responses:
`response_from_body` builds a message from the dict REST renders; `message_to_dict` turns any message
back into that dict (unset optional fields as None). Needs protobuf only: clients import it.

Conventions: a oneof named like a JSON field (`prompt`, `content`) holds that field's alternative
shapes; a message whose only field is `repeated ... items` is a plain list; google.protobuf.Struct and
Value are JSON as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, TypeVar, cast

from google.protobuf import json_format, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)
JSON_TYPES = frozenset({"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"})
MAX_EXACT_INT = 2**53  # doubles hold every integer up to here


class UnknownFieldError(ValueError):
    """A body key the message has no field for (the REST server would answer 'Unrecognized ...')."""

    def __init__(self, key: str) -> None:
        super().__init__(f"Unrecognized request argument supplied: {key}")
        self.key = key


# -- descriptors -----------------------------------------------------------------------------------
def _descriptor(message: Message) -> Descriptor:
    # the C (upb) descriptor behaves as the Python one; the stubs type the two apart
    return cast(Descriptor, message.DESCRIPTOR)


def _real_oneof(field: FieldDescriptor) -> str | None:
    """The oneof's name for a member of a real oneof; None for plain fields and proto3 `optional`."""
    oneof = field.containing_oneof
    if oneof is None or (len(oneof.fields) == 1 and oneof.name == "_" + field.name):
        return None
    return oneof.name


@cache
def _is_list_wrapper(descriptor: Descriptor) -> bool:
    fields = descriptor.fields
    return len(fields) == 1 and fields[0].name == "items" and fields[0].is_repeated


def _message_type(field: FieldDescriptor) -> Descriptor:
    if field.message_type is None:
        raise TypeError(f"{field.name} is not a message field")
    return field.message_type


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _is_json(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.full_name in JSON_TYPES


# -- message -> dict -------------------------------------------------------------------------------
def request_to_body(message: Message) -> dict[str, Any]:
    """Only the fields that are set, named as in JSON: what a REST client would have sent."""
    body: dict[str, Any] = {}
    for field, value in message.ListFields():
        item = _field_value(field, value, request_to_body)
        body[_real_oneof(field) or field.name] = _whole_numbers(item) if _is_json(field) else item
    return body


def _whole_numbers(value: Any) -> Any:
    """JSON as a client wrote it: Struct keeps every number as a double, so 8 arrives as 8.0, which a JSON
    schema's maxLength (say) refuses; whole numbers within a double's exact range become ints again."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_EXACT_INT:
        return int(value)
    if isinstance(value, dict):
        return {key: _whole_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole_numbers(item) for item in value]
    return value


def message_to_dict(message: Message) -> dict[str, Any]:
    """Every field, as REST renders it: unset optional fields and messages are None, lists are lists."""
    result: dict[str, Any] = {}
    for field in _descriptor(message).fields:
        oneof = _real_oneof(field)
        if oneof is not None:
            if message.WhichOneof(oneof) == field.name:
                result[oneof] = _field_value(field, getattr(message, field.name), message_to_dict)
            else:
                result.setdefault(oneof, None)
        elif field.has_presence and not message.HasField(field.name):
            result[field.name] = None
        else:
            result[field.name] = _field_value(field, getattr(message, field.name), message_to_dict)
    return result


def _field_value(field: FieldDescriptor, value: Any, convert: Any) -> Any:
    if _is_map(field):
        value_field = _message_type(field).fields_by_name["value"]
        if value_field.message_type is None:
            return dict(value)
        return {key: _single(value_field, item, convert) for key, item in value.items()}
    if field.is_repeated:
        return [_single(field, item, convert) for item in value]
    return _single(field, value, convert)


def _single(field: FieldDescriptor, value: Any, convert: Any) -> Any:
    kind = field.message_type
    if kind is None:
        return value
    if kind.full_name in JSON_TYPES:
        return json_format.MessageToDict(value)
    if _is_list_wrapper(kind):
        inner = kind.fields[0]
        return [_single(inner, item, convert) for item in value.items]
    return convert(value)


# -- dict -> message -------------------------------------------------------------------------------
def body_to_request(body: dict[str, Any], message_cls: type[M]) -> M:
    """The message for a REST-shaped dict (None values skipped). Raises UnknownFieldError for a key the
    message lacks, TypeError/ValueError for a value of the wrong type."""
    message = message_cls()
    _fill(message, body)
    return message


def _fill(message: Message, body: dict[str, Any]) -> None:
    if not isinstance(body, dict):
        raise TypeError(f"{_descriptor(message).name} must be given as a dict, got {type(body).__name__}")
    descriptor = _descriptor(message)
    for key, value in body.items():
        if value is None:
            continue
        field = descriptor.fields_by_name.get(key)
        if field is not None and _real_oneof(field) is None:
            _assign(message, field, value)
        elif key in descriptor.oneofs_by_name:
            _assign_oneof(message, descriptor.oneofs_by_name[key].fields, value)
        else:
            raise UnknownFieldError(key)


def _assign_oneof(message: Message, members: Sequence[FieldDescriptor], value: Any) -> None:
    """Pick the first member whose type takes `value` (a string, a list of strings, of ids, ...)."""
    errors = []
    for field in members:
        trial = type(message)()
        try:
            _assign(trial, field, value)
        except (TypeError, ValueError) as exc:
            errors.append(exc)
            continue
        _assign(message, field, value)
        return
    raise TypeError(f"{_real_oneof(members[0])}: no accepted shape fits {value!r:.60}") from errors[-1]


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    name = field.name
    if _is_map(field):
        target = getattr(message, name)
        for key, item in value.items():
            target[str(key)] = item
    elif field.is_repeated:
        items = value if isinstance(value, (list, tuple)) else [value]  # `stop: "x"` is `stop: ["x"]`
        target = getattr(message, name)
        if field.message_type is None:
            target.extend(items)
        else:
            for item in items:
                _assign_message(target.add(), field, item)
    elif field.message_type is not None:
        target = getattr(message, name)
        _assign_message(target, field, value)
        target.SetInParent()  # an empty dict still sets the field
    else:
        setattr(message, name, value)


def _assign_message(target: Message, field: FieldDescriptor, value: Any) -> None:
    kind = _message_type(field)
    if kind.full_name in JSON_TYPES:
        json_format.ParseDict(value, target)
    elif _is_list_wrapper(kind):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        _assign(target, kind.fields[0], list(value))
    else:
        _fill(target, value)


# -- responses (hot path: streamed chunks) ---------------------------------------------------------
def response_from_body(body: dict[str, Any], message_cls: type[M]) -> M:
    """A response message from the dict REST renders; the constructor does the work in C. Legacy
    completion logprobs (lists with nulls) go through google.protobuf.Value first."""
    choices = body.get("choices")
    if choices and any(isinstance(c.get("logprobs"), dict) and "token_logprobs" in c["logprobs"] for c in choices):
        body = {**body, "choices": [_legacy_logprobs_choice(c) for c in choices]}
    return message_cls(**body)


def _legacy_logprobs_choice(choice: dict[str, Any]) -> dict[str, Any]:
    block = choice.get("logprobs")
    if not block:
        return choice
    return {**choice, "logprobs": {**block, "token_logprobs": [json_value(v) for v in block["token_logprobs"]],
                                   "top_logprobs": [json_value(v) for v in block["top_logprobs"]]}}


def json_value(value: Any) -> struct_pb2.Value:
    if value is None:
        return struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)
    if isinstance(value, bool):
        return struct_pb2.Value(bool_value=value)
    if isinstance(value, (int, float)):
        return struct_pb2.Value(number_value=value)
    if isinstance(value, str):
        return struct_pb2.Value(string_value=value)
    if isinstance(value, dict):
        struct = struct_pb2.Struct()
        struct.update(value)
        return struct_pb2.Value(struct_value=struct)
    return struct_pb2.Value(list_value=struct_pb2.ListValue(values=[json_value(v) for v in value]))
