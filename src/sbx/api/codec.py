"""The one encoder and decoder of the wire contract, for servers, the SDK and the CLI alike (msgspec).

- :func:`encode` turns a wire type (a ``msgspec.Struct`` of this package, or plain JSON values) into compact
  UTF-8 JSON; :func:`to_builtins` into plain dicts and lists (for printing).
- :func:`decode_request` reads a request body *strictly* into its wire type, raising ``InvalidRequest`` (400)
  with a message naming the field and saying what to change:

  - the body must be UTF-8 JSON whose top level is an object; NaN/Infinity and duplicate keys are refused,
    as are nesting too deep to read and integers too long to hold;
  - every unknown field is named, with the known ones (a removed field names what replaces it);
  - a wrong type names the field, what was expected and what was sent; ``null`` is a wrong type for every
    field whose type does not admit it (omit a field to leave it unset);
  - integers must be JSON integers (``2.0`` and ``true`` are not integers).

- :func:`decode_answer` and :func:`convert_answer` read a server's answer *leniently*: fields this client does
  not know are ignored (a newer server may add some, as the spec allows), a malformed answer is ``Internal``
  (the server broke the contract, the caller did nothing wrong).

A wire type may declare, as class variables, ``required_hints`` (field name to the message given when it is
missing) and ``removed_fields`` (field name to the message given when a client still sends it).
"""

from __future__ import annotations

import functools
import json
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, TypeVar, Union, get_args, get_origin

import msgspec

from sbx.api.errors import Internal, InvalidRequest

T = TypeVar("T")

_ENCODER: Final = msgspec.json.Encoder()


def encode(value: object) -> bytes:
    """``value`` as compact UTF-8 JSON (``UNSET`` fields of a Struct are left out)."""
    return _ENCODER.encode(value)


_DECODER: Final = msgspec.json.Decoder()


def to_builtins(value: object) -> Any:
    """``value`` as plain JSON values (dicts, lists, strings, numbers, booleans, None), exactly as it reads
    on the wire (bytes as base64, tuples as lists, ``UNSET`` fields left out)."""
    return _DECODER.decode(_ENCODER.encode(value))


# --- answers (lenient) ---------------------------------------------------------------------------------


def decode_answer(body: bytes, type_: type[T], what: str) -> T:
    """A server's JSON answer as ``type_``; unknown fields ignored; ``Internal`` naming ``what`` otherwise."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
        raise Internal(f"the server sent a malformed {what}: {exc}") from None


def convert_answer(value: object, type_: type[T], what: str) -> T:
    """An already decoded answer (an ndjson line, a nested value) as ``type_``; as :func:`decode_answer`."""
    try:
        return msgspec.convert(value, type_, strict=True)
    except msgspec.ValidationError as exc:
        raise Internal(f"the server sent a malformed {what}: {exc}") from None


# --- requests (strict) ---------------------------------------------------------------------------------


def decode_request(body: bytes, type_: type[T], *, empty_is_object: bool = False) -> T:
    """A request body as the wire type ``type_`` (a Struct), or ``InvalidRequest`` saying what is wrong.

    ``empty_is_object``: an empty body reads as ``{}`` (bodies whose every field is optional), instead of
    being refused.
    """
    obj = decode_object(body, empty_is_object=empty_is_object)
    return convert_request(obj, type_)


def convert_request(obj: Mapping[str, Any], type_: type[T], where: str = "") -> T:
    """An already decoded JSON object as ``type_``, with the checks and messages of :func:`decode_request`;
    ``where`` prefixes field names in messages (``"network."`` for a nested object)."""
    _check_unknown(obj, type_, where)
    try:
        return msgspec.convert(obj, type_, strict=True)
    except msgspec.ValidationError as exc:
        raise _translate(str(exc), obj, type_, where) from None


def decode_object(body: bytes, *, empty_is_object: bool = False) -> dict[str, Any]:
    """Decode a body that must be a UTF-8 JSON object; 400 for anything else."""
    if not body.strip():
        if empty_is_object:
            return {}
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not UTF-8; send UTF-8 JSON") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply; send a flat JSON object") from None
    except ValueError:  # an integer literal past the interpreter's digit limit
        raise InvalidRequest("the request body holds a number too long to read; send a shorter one") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {kind_of(obj)}")
    _check_text(obj, "")
    return obj


def _check_text(value: object, where: str) -> None:
    """400 for a string (or key) holding an unpaired surrogate escape, which JSON allows and UTF-8 cannot
    carry."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"{where or 'a value'}: contains an unpaired surrogate escape; send valid UTF-8 text"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            name = f"{where}.{key}" if where else str(key)
            _check_text(key, name)
            _check_text(item, name)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidRequest(f"the field {key!r} appears twice in one JSON object; give it once")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise InvalidRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def kind_of(value: object) -> str:
    """What a decoded JSON value is, for messages: ``a string``, ``an integer``, ``null``, ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


# --- type walking ----------------------------------------------------------------------------------------


def _struct_fields(type_: Any) -> tuple[str, ...] | None:
    """The wire names of a Struct type's fields, in order; None for any other type."""
    if isinstance(type_, type) and issubclass(type_, msgspec.Struct):
        return tuple(type_.__struct_encode_fields__)
    return None


@functools.cache
def _hints(type_: Any) -> dict[str, Any]:
    # Cached: resolving a Struct's (string) annotations costs tens of microseconds, per request otherwise.
    return typing.get_type_hints(type_, include_extras=False)


@functools.cache
def _field_types(struct: Any) -> dict[str, Any]:
    """A Struct's wire field names to their annotations."""
    hints = _hints(struct)
    return {
        enc: hints.get(field)
        for field, enc in zip(struct.__struct_fields__, struct.__struct_encode_fields__, strict=True)
    }


def _members(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``X | None | UnsetType``), or the annotation itself."""
    origin = get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return get_args(annotation)
    return (annotation,)


def _check_unknown(obj: object, annotation: Any, where: str) -> None:
    """400 naming every unknown field of ``obj`` (and of nested objects) against ``annotation``."""
    for member in _members(annotation):
        fields = _struct_fields(member)
        if fields is not None and isinstance(obj, dict):
            unknown = [k for k in obj if k not in fields]
            if unknown:
                removed: Mapping[str, str] = getattr(member, "removed_fields", {})
                for key in unknown:
                    if key in removed:
                        raise InvalidRequest(removed[key])
                names = ", ".join(repr(where + k) for k in unknown)
                plural = "s" if len(unknown) > 1 else ""
                raise InvalidRequest(f"unknown field{plural} {names}; the fields are {', '.join(fields)}")
            for key, value in obj.items():
                _check_unknown(value, _pick_struct_field(member, key), f"{where}{key}.")
            return
        origin = get_origin(member)
        if origin in (list, tuple) and isinstance(obj, list):
            item_type = get_args(member)[0] if get_args(member) else Any
            base = where.removesuffix(".")
            for i, item in enumerate(obj):
                _check_unknown(item, item_type, f"{base}[{i}].")
            return
        if origin is dict and isinstance(obj, dict):
            value_type = get_args(member)[1]
            for key, value in obj.items():
                _check_unknown(value, value_type, f"{where}{key}.")
            return


def describe(annotation: Any) -> str:
    """What a value of ``annotation`` is, for messages: ``an integer``, ``an array of strings``, ..."""
    members = [m for m in _members(annotation) if m is not msgspec.UnsetType]
    nullable = type(None) in members
    members = [m for m in members if m is not type(None)]
    numeric = {int, float}
    if members and set(members) <= numeric and float in members:
        text = "a number"
    else:
        text = " or ".join(_describe_one(m) for m in members) or "a value"
    return f"{text} or null" if nullable else text


def _describe_one(annotation: Any) -> str:
    if annotation is int:
        return "an integer"
    if annotation is float:
        return "a number"
    if annotation is str:
        return "a string"
    if annotation is bool:
        return "a boolean"
    if annotation is bytes:
        return "a string (standard base64)"
    origin = get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in get_args(annotation))
    if origin in (list, tuple):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return "an array of " + _plural(args[0]) if args else "an array"
    if origin is dict:
        return "an object"
    fields = _struct_fields(annotation)
    if fields is not None:
        return "an object " + _shape(annotation)
    return "a value"


def _plural(annotation: Any) -> str:
    simple = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
    if annotation in simple:
        return simple[annotation]
    fields = _struct_fields(annotation)
    if fields is not None:
        return _shape(annotation)
    return "values"


def _shape(struct: Any) -> str:
    """``{name, path, read_only?}``: the fields of a Struct, optional ones marked."""
    required = set(
        struct.__struct_fields__[: len(struct.__struct_fields__) - len(struct.__struct_defaults__)]
    )
    names = [
        enc if field in required else f"{enc}?"
        for field, enc in zip(struct.__struct_fields__, struct.__struct_encode_fields__, strict=True)
    ]
    return "{" + ", ".join(names) + "}"


# --- msgspec's errors in this service's words ---------------------------------------------------------------

_EXPECTED = re.compile(r"^Expected `(?P<expected>[^`]+)`, got `(?P<got>[^`]+)`(?: - at `\$(?P<path>.*)`)?$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`(?: - at `\$(?P<path>.*)`)?$")
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>.*)`)?$")
_TOKEN = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_ENUM = "Invalid enum value "
_GOT = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "null": "null",
    "array": "an array",
    "object": "an object",
}


def _translate(message: str, obj: Any, type_: Any, where: str) -> InvalidRequest:
    if (m := _EXPECTED.match(message)) is not None:
        got = m.group("got")
        path, annotation = _resolve(m.group("path") or "", obj, type_, _GOT.get(got, got))
        name = (where + path).rstrip(".")
        expected = describe(annotation) if annotation is not None else m.group("expected")
        hint = "; omit the field to leave it unset" if got == "null" else ""
        return InvalidRequest(f"{name}: expected {expected}, got {_GOT.get(got, got)}{hint}")
    if (m := _MISSING.match(message)) is not None:
        path, annotation = _resolve(m.group("path") or "", obj, type_, None)
        field = m.group("field")
        hints: Mapping[str, str] = {}
        for member in _members(annotation):
            hints = getattr(member, "required_hints", hints)
        if field in hints:
            return InvalidRequest(hints[field])
        prefix = f"{where}{path}." if path else where
        return InvalidRequest(f"{prefix}{field} is required")
    m = _AT.match(message)
    assert m is not None
    path, annotation = _resolve(m.group("path") or "", obj, type_, None)
    name = (where + path).rstrip(".")
    what = m.group("what")
    if what.startswith(_ENUM) and annotation is not None and name:
        # msgspec names the value only; the message also names the values that are accepted.
        return InvalidRequest(f"{name}: expected {describe(annotation)}, got {what[len(_ENUM) :]}")
    if what == "Invalid base64 encoded string":
        return InvalidRequest(f"{name}: expected standard base64 (A-Z a-z 0-9 + /, '=' padding)")
    return InvalidRequest(f"{name}: {what[0].lower() + what[1:]}" if name else what)


def _resolve(path: str, obj: Any, type_: Any, got: str | None) -> tuple[str, Any]:
    """msgspec's path (``.env[...]``) as a field name (``env.A``), and the annotation found there.

    ``[...]`` is a key of an object: the first value of the kind msgspec reported (``got``) is the one it
    stopped at, as it checks in order.
    """
    name = ""
    annotation: Any = type_
    value: Any = obj
    for token in _TOKEN.finditer(path):
        key, index = token.group(1), token.group(2)
        if key is not None:
            name = f"{name}.{key}" if name else key
            annotation = _pick_struct_field(annotation, key)
            value = value.get(key) if isinstance(value, dict) else None
        elif index == "...":
            chosen = None
            if isinstance(value, dict):
                chosen = next((k for k, v in value.items() if got is None or kind_of(v) == got), None)
            name = f"{name}.{chosen}" if chosen is not None else f"{name}[...]"
            annotation = _pick_container_item(annotation, dict)
            value = value.get(chosen) if isinstance(value, dict) and chosen is not None else None
        else:
            name = f"{name}[{index}]"
            annotation = _pick_container_item(annotation, list)
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
    return name, annotation


def _pick_struct_field(annotation: Any, key: str) -> Any:
    for member in _members(annotation):
        if _struct_fields(member) is not None:
            found = _field_types(member).get(key)
            if found is not None:
                return found
    return None


def _pick_container_item(annotation: Any, kind: type) -> Any:
    for member in _members(annotation):
        origin = get_origin(member)
        if kind is dict and origin is dict:
            return get_args(member)[1]
        if kind is list and origin in (list, tuple):
            args = [a for a in get_args(member) if a is not Ellipsis]
            return args[0] if args else None
    return None
