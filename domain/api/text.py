"""Text the platform can carry and keep: what the HTTP edge refuses before anything is queued or stored.

Two rules, each with the place it comes from:

    code points             where they fail                                 refused in
    U+D800-U+DFFF (lone     UTF-8 cannot encode them: msgpack (NATS) and     every string of a body
      surrogates; JSON's      Postgres both raise (a 500, unrefused)
      "\\ud800" escapes)
    U+0000 (NUL)            Postgres ``text`` and ``jsonb`` refuse it        every field stored in a text or jsonb
                                                                             column (``StoredText``): user,
                                                                             safety_identifier, metadata, a
                                                                             conversation's system prompt, model and
                                                                             turns, a batch line's custom_id, ...

A prompt may hold U+0000 (JSON allows it and a user may mean it), and so may a model's reply (a byte-level
tokenizer has a token for byte 0): they travel in msgpack and are stored only in ``json`` columns (batch lines,
responses, conversation messages), which keep it. A refusal is a 400 ``invalid_value`` naming the field, so a request
is never served and then left unbilled because its usage row could not be written (jobs/usage_writer.py bills
what it knows of a record Postgres still refuses).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

SURROGATES = re.compile("[\ud800-\udfff]")
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def invalid_text(why: str, param: str | None = None) -> PydanticCustomError:
    """A refused string (gateway/errors.py answers it 400 ``invalid_value``, naming ``param`` or the field)."""
    return PydanticCustomError("invalid_text", "{why}", {"why": why, **({"param": param} if param else {})})


def describe(text: str) -> str:
    """Why ``text`` cannot be kept (call only when ``UNSTORABLE`` matched it)."""
    match = UNSTORABLE.search(text)
    assert match is not None, "describe() is for text UNSTORABLE matched"
    found = match.group()
    if found == "\x00":
        return "it contains U+0000 (NUL), which cannot be stored"
    return f"it contains U+{ord(found):04X}, a lone surrogate, which is not valid Unicode text"


def _storable(text: str) -> str:
    if UNSTORABLE.search(text):
        raise invalid_text(describe(text))
    return text


# A field that Postgres keeps in a text or jsonb column.
StoredText = Annotated[str, AfterValidator(_storable)]


def storable(value: Any) -> Any:
    """``value`` (text, or JSON made of it) with every refused code point replaced by U+FFFD: for what the platform
    writes itself and must not fail on (an error that quotes a client's text, a record already served)."""
    if isinstance(value, str):
        return UNSTORABLE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {storable(k): storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    return value


def unencodable_path(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where the first string holding a lone surrogate is in a parsed JSON ``value``, or None; a key is named by
    its mapping (the key itself cannot be written back)."""
    if isinstance(value, str):
        return path if SURROGATES.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and SURROGATES.search(key):
                return path
            if (found := unencodable_path(item, (*path, key))) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := unencodable_path(item, (*path, i))) is not None:
                return found
    return None


def check_encodable(data: Any) -> Any:
    """``data`` (a body as parsed JSON) unchanged, or the refusal of its first string UTF-8 cannot encode."""
    found = unencodable_path(data)
    if found is not None:
        param = ".".join(str(p) for p in found) or None
        raise invalid_text("it contains a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not valid "
                           "Unicode text", param)
    return data


def field_path(error: Mapping[str, Any]) -> list[str]:
    """The field a pydantic error (one of ``ValidationError.errors()``) points at, as path parts; a refused mapping
    key is named by its mapping (never by the key's own text), a refusal of a whole body by the ``param`` it
    carries."""
    loc = [str(p) for p in error.get("loc", ())]
    if error.get("type") != "invalid_text":
        return loc
    if loc[-1:] == ["[key]"]:
        return loc[:-2]
    param = (error.get("ctx") or {}).get("param")
    return [*loc, *param.split(".")] if param else loc
