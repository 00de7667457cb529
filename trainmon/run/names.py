"""How a tensor name is written: every output (TensorBoard tags, CSV, the statistics store, anomaly records,
the manifest, dumps and their index) holds it as valid UTF-8 text without NUL.

A module or parameter name is any Python string: file systems and ``os.fsdecode`` give names holding lone
surrogates (``"\\udc80"``), which UTF-8 cannot hold, and a ``ModuleDict`` key may hold a NUL. Such characters
are written as backslash escapes, ``\\uXXXX`` (four lowercase hex digits), and a backslash as ``\\\\``, so the
encoding is lossless (:func:`decode_name` gives the name back) and no two names are written alike. Names
without a backslash, NUL or lone surrogate (all names PyTorch models usually have) are written as they are.
"""

from __future__ import annotations

import re

__all__ = ["decode_name", "encode_name"]

_ESCAPED = re.compile("[\\\\\x00\ud800-\udfff]")
_ESCAPE = re.compile(r"\\(\\|u[0-9a-f]{4})")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return "\\\\" if c == "\\" else f"\\u{ord(c):04x}"


def encode_name(name: str) -> str:
    """``name`` as every output writes it (the name itself when it needs no escape)."""
    if _ESCAPED.search(name) is None:
        return name
    return _ESCAPED.sub(_escape, name)


def _unescape(m: re.Match[str]) -> str:
    code = m.group(1)
    return "\\" if code == "\\" else chr(int(code[1:], 16))


def decode_name(text: str) -> str:
    """The name :func:`encode_name` wrote as ``text``."""
    if "\\" not in text:
        return text
    return _ESCAPE.sub(_unescape, text)
