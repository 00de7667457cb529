"""The precheck's wire format: data only, authenticated, size-checked. A frame is a fixed prefix, a JSON
header and the raw bytes of its tensors; nothing in it is ever unpickled or evaluated.

    prefix:  b"TMPC" | version (1 byte) | header length (u32) | payload length (u64) | HMAC-SHA256 (32 bytes)
    header:  UTF-8 JSON object; ``"tensors"``: [{"dtype", "shape", "offset", "nbytes"}, ...] into the payload
    payload: the tensors' bytes

The HMAC (a shared secret, over the version, both lengths, the header and the payload) is checked before the
header is parsed; the lengths are checked against the limits before anything past the prefix is read, so a
frame can make the reader allocate no more than its limits. A frame that fails any check raises
:class:`FrameError` naming why.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

MAGIC, VERSION = b"TMPC", 1
_PREFIX = struct.Struct(">4sBIQ32s")
PREFIX_BYTES = _PREFIX.size

_SENDABLE = (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
DTYPES: dict[str, torch.dtype] = {str(dtype).removeprefix("torch."): dtype for dtype in _SENDABLE}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class FrameError(ValueError):
    """A frame refused: why, in words."""


@dataclass(frozen=True)
class Limits:
    header_bytes: int = 1 << 20
    payload_bytes: int = 1 << 30
    tensors: int = 4096
    dims: int = 16


def _mac(key: bytes, version: int, header: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(struct.pack(">BIQ", version, len(header), len(payload)))
    mac.update(header)
    mac.update(payload)
    return mac.digest()


def encode(message: dict[str, Any], tensors: list[torch.Tensor], key: bytes) -> bytes:
    """One frame of ``message`` (JSON-able) and ``tensors`` (contiguous CPU copies are written)."""
    specs, chunks, offset = [], [], 0
    for tensor in tensors:
        if tensor.dtype not in _NAMES:
            raise FrameError(f"dtype {tensor.dtype} cannot be sent")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        specs.append(
            {
                "dtype": _NAMES[tensor.dtype],
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": len(data),
            }
        )
        chunks.append(data)
        offset += len(data)
    header = json.dumps({**message, "tensors": specs}, separators=(",", ":")).encode()
    payload = b"".join(chunks)
    return (
        _PREFIX.pack(MAGIC, VERSION, len(header), len(payload), _mac(key, VERSION, header, payload))
        + header
        + payload
    )


def decode(frame: bytes, key: bytes, limits: Limits = Limits()) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The message and tensors of one whole frame, or :class:`FrameError`."""
    header_len, payload_len, mac = _check_prefix(frame[:PREFIX_BYTES], limits)
    if len(frame) != PREFIX_BYTES + header_len + payload_len:
        raise FrameError(
            f"frame is {len(frame)} bytes, its prefix says {PREFIX_BYTES + header_len + payload_len}"
        )
    header = frame[PREFIX_BYTES : PREFIX_BYTES + header_len]
    return _parse(header, frame[PREFIX_BYTES + header_len :], mac, key, limits)


def read(
    stream: BinaryIO, key: bytes, limits: Limits = Limits()
) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
    """The next frame from ``stream`` (None at its clean end), reading no more than the limits allow."""
    prefix = _read_exactly(stream, PREFIX_BYTES, allow_end=True)
    if prefix is None:
        return None
    header_len, payload_len, mac = _check_prefix(prefix, limits)
    header = _read_exactly(stream, header_len)
    payload = _read_exactly(stream, payload_len)
    return _parse(header, payload, mac, key, limits)


def _read_exactly(stream: BinaryIO, n: int, allow_end: bool = False) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            if allow_end and left == n:
                return None
            raise FrameError(f"stream ended {left} bytes short of a frame")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _check_prefix(prefix: bytes, limits: Limits) -> tuple[int, int, bytes]:
    if len(prefix) != PREFIX_BYTES:
        raise FrameError(f"frame shorter than its {PREFIX_BYTES}-byte prefix")
    magic, version, header_len, payload_len, mac = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError("not a precheck frame (bad magic)")
    if version != VERSION:
        raise FrameError(f"frame version {version}, this reader reads {VERSION}")
    if header_len > limits.header_bytes or payload_len > limits.payload_bytes:
        raise FrameError(f"frame too large: header {header_len} B, payload {payload_len} B")
    return header_len, payload_len, mac


def _parse(header: bytes, payload: bytes, mac: bytes, key: bytes, limits: Limits) -> tuple[dict, list]:
    if not hmac.compare_digest(mac, _mac(key, VERSION, header, payload)):
        raise FrameError("frame not authenticated (wrong key or altered)")
    try:
        message = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise FrameError(f"header is not JSON: {error}") from None
    except RecursionError:
        raise FrameError("header nested too deeply") from None
    if not isinstance(message, dict) or not isinstance(message.get("tensors", []), list):
        raise FrameError("header is not a JSON object with a list of tensors")
    specs = message.pop("tensors", [])
    if len(specs) > limits.tensors:
        raise FrameError(f"{len(specs)} tensors, at most {limits.tensors}")
    return message, [_tensor(spec, payload, limits) for spec in specs]


def _tensor(spec: Any, payload: bytes, limits: Limits) -> torch.Tensor:
    if not isinstance(spec, dict):
        raise FrameError("a tensor's description is not an object")
    dtype = DTYPES.get(spec.get("dtype"))
    shape, offset, nbytes = spec.get("shape"), spec.get("offset"), spec.get("nbytes")
    if dtype is None:
        raise FrameError(f"unknown dtype {spec.get('dtype')!r}")
    ints = isinstance(offset, int) and isinstance(nbytes, int) and not isinstance(offset, bool)
    if not (isinstance(shape, list) and len(shape) <= limits.dims and ints):
        raise FrameError("a tensor's shape, offset or size is malformed")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise FrameError(f"bad shape {shape!r}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes != numel * itemsize or offset < 0 or offset + nbytes > len(payload):
        raise FrameError(f"tensor of shape {shape} {spec['dtype']} does not fit the payload at {offset}")
    data = bytearray(payload[offset : offset + nbytes])
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
