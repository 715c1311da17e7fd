"""What Triton's JSON parser says of a document: rapidjson's first syntax error, in its words
and at its offset, for the bodies msgspec refuses (json_body.decode_json).

Triton reads every HTTP body with TritonJson, rapidjson underneath (Parse with
kParseNanAndInfFlag, no encoding validation): its errors reach the client as "failed to
parse the request JSON buffer: <reason> at <offset>". msgspec's grammar is the same but for
what rapidjson also accepts (NaN, Inf, Infinity; a NUL byte ends the document, as the end
of the buffer does; bytes that are not UTF-8), and its words and offsets are its own. This
walk follows rapidjson's GenericReader (ParseValue, ParseObject, ParseArray,
ParseStringToStream, ParseNumber) step for step, with an explicit stack (no recursion at any
depth). It runs only for a body msgspec refused; runs of plain array elements (the bulk of
a tensor's "data") are skipped by one regular expression, so a large body costs little more
than a scan.
"""
from __future__ import annotations

import re

__all__ = ["DOCUMENT_EMPTY", "scan"]

DOCUMENT_EMPTY = "The document is empty."
_ROOT_NOT_SINGULAR = "The document root must not be followed by other values."
_VALUE_INVALID = "Invalid value."
_MISS_NAME = "Missing a name for object member."
_MISS_COLON = "Missing a colon after a name of object member."
_MISS_COMMA_OBJECT = "Missing a comma or '}' after an object member."
_MISS_COMMA_ARRAY = "Missing a comma or ']' after an array element."
_BAD_HEX = "Incorrect hex digit after \\u escape in string."
_BAD_SURROGATE = "The surrogate pair in string is invalid."
_BAD_ESCAPE = "Invalid escape character in string."
_MISS_QUOTE = "Missing a closing quotation mark in string."
_TOO_BIG = "Number too big to be stored in double."
_MISS_FRACTION = "Miss fraction part in number."
_MISS_EXPONENT = "Miss exponent in number."

_WS = re.compile(rb"[ \t\n\r]*")
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*')          # string bytes that need no look
_DIGITS = re.compile(rb"[0-9]*")
_HEX4 = re.compile(rb"[0-9a-fA-F]{4}")
_ESCAPES = frozenset(b'"\\/bfnrt')
# Array elements that cannot fail, each followed by a comma: a number no larger than 1e299
# (rapidjson's overflow checks cannot trigger), NaN or an infinity, a string without \u
# escapes, a literal.
_BULK = re.compile(
    rb'(?:(?:-?(?:0|[1-9][0-9]{0,199})(?:\.[0-9]+)?(?:[eE][+-]?[0-9]{1,2})?'
    rb'|-?(?:NaN|Inf(?:inity)?)'
    rb'|"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"|true|false|null)[ \t\n\r]*,[ \t\n\r]*)*+')
_SPELLINGS = re.compile(rb'"(?:[^"\\]|\\.)*"|(-NaN|-?Inf(?!inity))')   # (group 1 only outside strings)
_MAX_DIGITS_VALUE = 1.7976931348623157e307          # rapidjson's integer-part overflow check

_VALUE, _NAME, _AFTER = 0, 1, 2


class _Error(Exception):
    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason)
        self.reason, self.offset = reason, offset


def scan(data: bytes, spellings: list[tuple[int, int, bytes]] | None = None
         ) -> tuple[str | None, int]:
    """(rapidjson's error, its offset) for ``data``; (None, end) when rapidjson reads it,
    ``end`` where its document ends (the buffer's end or a NUL byte). ``spellings`` gets
    (start, end, Python's spelling) of each constant rapidjson reads and Python's json
    does not: -NaN, Inf, -Inf."""
    try:
        return None, _walk(data, [] if spellings is None else spellings)
    except _Error as e:
        return e.reason, e.offset


def _end(pattern: re.Pattern[bytes], data: bytes, i: int) -> int:
    """Where ``pattern`` (it matches the empty string too) ends when matched at ``i``."""
    m = pattern.match(data, i)
    return m.end() if m is not None else i


def _peek(data: bytes, i: int) -> int:
    return data[i] if i < len(data) else 0   # rapidjson's Peek() at the end: '\0'


def _walk(data: bytes, spellings: list[tuple[int, int, bytes]]) -> int:
    i = _end(_WS, data, 0)
    if _peek(data, i) == 0:
        raise _Error(DOCUMENT_EMPTY, i)
    stack = bytearray()                     # b"{" / b"[" of each open container
    state = _VALUE
    while True:
        if state == _VALUE:
            c = _peek(data, i)
            if c == 0x7B:                   # {
                i = _end(_WS, data, i + 1)
                if _peek(data, i) == 0x7D:
                    i, state = i + 1, _AFTER
                else:
                    stack.append(c)
                    state = _NAME
                continue
            if c == 0x5B:                   # [
                i = _end(_WS, data, i + 1)
                if _peek(data, i) == 0x5D:
                    i, state = i + 1, _AFTER
                else:
                    stack.append(c)
                    i = _bulk(data, i, spellings)
                continue
            if c == 0x22:
                i = _string(data, i)
            elif c in b"ntf":
                i = _literal(data, i, {0x6E: b"null", 0x74: b"true", 0x66: b"false"}[c])
            else:
                i = _number(data, i, spellings)
            state = _AFTER
        elif state == _NAME:                # after "{" or "," in an object, spaces skipped
            if _peek(data, i) != 0x22:
                raise _Error(_MISS_NAME, i)
            i = _end(_WS, data, _string(data, i))
            if _peek(data, i) != 0x3A:
                raise _Error(_MISS_COLON, i)
            i = _end(_WS, data, i + 1)
            state = _VALUE
        else:                               # a value ended
            i = _end(_WS, data, i)
            c = _peek(data, i)
            if not stack:
                if c != 0:
                    raise _Error(_ROOT_NOT_SINGULAR, i)
                return i
            if stack[-1] == 0x7B:
                if c == 0x2C:
                    i, state = _end(_WS, data, i + 1), _NAME
                elif c == 0x7D:
                    i = i + 1
                    stack.pop()
                else:
                    raise _Error(_MISS_COMMA_OBJECT, i)
            elif c == 0x2C:
                i = _bulk(data, _end(_WS, data, i + 1), spellings)
                state = _VALUE
            elif c == 0x5D:
                i = i + 1
                stack.pop()
            else:
                raise _Error(_MISS_COMMA_ARRAY, i)


def _bulk(data: bytes, i: int, spellings: list[tuple[int, int, bytes]]) -> int:
    """Skip the plain elements (_BULK) from ``i``, noting rapidjson's own spellings among
    them (looked for only where there may be one)."""
    end = _end(_BULK, data, i)
    if data.find(b"Inf", i, end) >= 0 or data.find(b"-NaN", i, end) >= 0:
        for m in _SPELLINGS.finditer(data, i, end):
            if m.group(1):
                word = m.group(1)
                spellings.append((m.start(), m.end(), b"NaN" if word == b"-NaN" else word + b"inity"))
    return end


def _string(data: bytes, i: int) -> int:
    """ParseStringToStream from the opening quote at ``i``; returns the offset after it."""
    i += 1
    while True:
        i = _end(_PLAIN, data, i)
        c = _peek(data, i)
        if c == 0x22:
            return i + 1
        if c == 0x5C:                       # backslash
            escape = i
            e = _peek(data, i + 1)
            if e in _ESCAPES:
                i += 2
                continue
            if e != 0x75:                   # u
                raise _Error(_BAD_ESCAPE, escape)
            code = _hex4(data, i + 2, escape)
            i += 6
            if 0xD800 <= code <= 0xDBFF:    # a high surrogate: its low one must follow
                if _peek(data, i) != 0x5C or _peek(data, i + 1) != 0x75:
                    raise _Error(_BAD_SURROGATE, escape)
                if not 0xDC00 <= _hex4(data, i + 2, escape) <= 0xDFFF:
                    raise _Error(_BAD_SURROGATE, escape)
                i += 6
            continue
        raise _Error(_MISS_QUOTE if c == 0 else _BAD_ESCAPE, i)   # a control character


def _hex4(data: bytes, i: int, escape: int) -> int:
    m = _HEX4.match(data, i)
    if m is None:
        raise _Error(_BAD_HEX, escape)
    return int(m.group(), 16)


def _literal(data: bytes, i: int, word: bytes) -> int:
    for k in range(1, len(word)):
        if _peek(data, i + k) != word[k]:
            raise _Error(_VALUE_INVALID, i + k)
    return i + len(word)


def _number(data: bytes, i: int, spellings: list[tuple[int, int, bytes]]) -> int:
    """ParseNumber (kParseNanAndInfFlag) from ``i``; returns the offset after it."""
    start = i
    if _peek(data, i) == 0x2D:              # -
        i += 1
    c = _peek(data, i)
    if c == 0x30:
        i += 1
    elif 0x31 <= c <= 0x39:
        end = _end(_DIGITS, data, i)
        if end - i > 1 and float(data[i:end - 1]) >= _MAX_DIGITS_VALUE:
            raise _Error(_TOO_BIG, start)
        i = end
    elif c in (0x49, 0x4E):                 # Inf, Infinity, NaN (no fraction, no exponent)
        word = b"NaN" if c == 0x4E else b"Inf"
        for k in range(1, 3):
            if _peek(data, i + k) != word[k]:
                raise _Error(_VALUE_INVALID, i + k)
        i += 3
        if word == b"Inf" and _peek(data, i) == 0x69:
            for k, ch in enumerate(b"inity"):
                if _peek(data, i + k) != ch:
                    raise _Error(_VALUE_INVALID, i + k)
            i += 5
        elif word == b"Inf":
            spellings.append((start, i, data[start:i] + b"inity"))
        elif i - start == 4:                # -NaN (the sign means nothing to a NaN)
            spellings.append((start, i, b"NaN"))
        return i
    else:
        raise _Error(_VALUE_INVALID, i)
    fraction = 0
    if _peek(data, i) == 0x2E:              # .
        end = _end(_DIGITS, data, i + 1)
        if end == i + 1:
            raise _Error(_MISS_FRACTION, i + 1)
        fraction, i = end - i - 1, end
    if _peek(data, i) in (0x65, 0x45):      # e, E
        i += 1
        minus = _peek(data, i) == 0x2D
        if _peek(data, i) in (0x2B, 0x2D):
            i += 1
        end = _end(_DIGITS, data, i)
        if end == i:
            raise _Error(_MISS_EXPONENT, i)
        if not minus:   # rapidjson stops at the first digit that takes it past the limit
            digits, limit = data[i:end].lstrip(b"0"), str(308 + fraction).encode()
            if len(digits) > len(limit) or (len(digits) == len(limit) and digits > limit):
                raise _Error(_TOO_BIG, start)
        i = end
    return i
