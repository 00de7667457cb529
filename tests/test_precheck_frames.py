"""The precheck's frames: a round trip keeps every tensor bit for bit; a frame with the wrong key, altered,
truncated, oversized or malformed is refused with a FrameError naming why, never a crash nor an allocation
beyond the limits; 1,000 random and mutated frames (fuzz) are all refused cleanly; nothing on the path
unpickles (pickle's loaders are made to fail for the whole test)."""

from __future__ import annotations

import io
import json
import pickle
import random
import struct

import pytest
import torch

from trainmon.precheck import frames
from trainmon.precheck.frames import FrameError, Limits, decode, encode, read

KEY = b"a shared secret of the job"


@pytest.fixture(autouse=True)
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("something unpickled on the frame path")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)


def sample() -> tuple[dict, list[torch.Tensor]]:
    tensors = [
        torch.randn(3, 4, dtype=torch.bfloat16),
        torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.float16),
        torch.arange(6, dtype=torch.int64).reshape(2, 3),
        torch.zeros(0, 5),
        torch.tensor(True),
    ]
    return {"kind": "call", "name": "torch.nn.functional.gelu.0.forward", "module": "blocks.0"}, tensors


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_round_trip_bit_for_bit_through_a_stream():
    message, tensors = sample()
    data = encode(message, tensors, KEY)
    got, back = decode(data, KEY)
    assert got == message
    assert [(t.dtype, t.shape, bits(t)) for t in back] == [(t.dtype, t.shape, bits(t)) for t in tensors]
    stream = io.BytesIO(data + encode({"kind": "end"}, [], KEY))
    assert (
        read(stream, KEY)[0] == message
        and read(stream, KEY)[0] == {"kind": "end"}
        and read(stream, KEY) is None
    )


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda d: d[:10], "shorter than"),
        (lambda d: b"XXXX" + d[4:], "bad magic"),
        (lambda d: d[:4] + b"\x09" + d[5:], "version"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "not authenticated"),
        (lambda d: d + b"tail", "prefix says"),
        (lambda d: d[:5] + struct.pack(">I", 1 << 30) + d[9:], "too large"),
    ],
    ids=["truncated", "magic", "version", "altered", "trailing", "oversized"],
)
def test_damaged_frames_are_refused_naming_why(damage, why):
    data = encode(*sample(), KEY)
    with pytest.raises(FrameError, match=why):
        decode(damage(data), KEY)


def test_the_wrong_key_is_refused():
    with pytest.raises(FrameError, match="not authenticated"):
        decode(encode(*sample(), KEY), b"another key")


def forged(header: object, payload: bytes = b"") -> bytes:
    """A frame with a valid MAC around any header (a peer that holds the key but sends nonsense)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    mac = frames._mac(KEY, frames.VERSION, raw, payload)
    return frames._PREFIX.pack(frames.MAGIC, frames.VERSION, len(raw), len(payload), mac) + raw + payload


@pytest.mark.parametrize(
    "header, payload, why",
    [
        (b"\xff\xfe", b"", "not JSON"),
        ([1, 2], b"", "JSON object"),
        (
            {"tensors": [{"dtype": "complex128", "shape": [1], "offset": 0, "nbytes": 16}]},
            b"",
            "unknown dtype",
        ),
        ({"tensors": [{"dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 4}]}, b"1234", "bad shape"),
        (
            {"tensors": [{"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}]},
            b"1234",
            "does not fit",
        ),
        (
            {"tensors": [{"dtype": "float32", "shape": [1], "offset": 4, "nbytes": 4}]},
            b"1234",
            "does not fit",
        ),
        (
            {"tensors": [{"dtype": "float32", "shape": [1 << 62, 1 << 62], "offset": 0, "nbytes": 4}]},
            b"1234",
            "does not fit",
        ),
        ({"tensors": ["x"]}, b"", "not an object"),
        (b"[" * 200_000 + b"]" * 200_000, b"", "nested too deeply"),
        (
            {"tensors": [{"dtype": "float32", "shape": [1] * 40, "offset": 0, "nbytes": 4}]},
            b"1234",
            "malformed",
        ),
    ],
)
def test_authenticated_nonsense_is_refused(header, payload, why):
    with pytest.raises(FrameError, match=why):
        decode(forged(header, payload), KEY)


def test_a_stream_never_reads_past_the_limits():
    data = encode({"kind": "call"}, [torch.zeros(1000)], KEY)
    with pytest.raises(FrameError, match="too large"):
        read(io.BytesIO(data), KEY, Limits(payload_bytes=100))
    with pytest.raises(FrameError, match="short of a frame"):
        read(io.BytesIO(data[:-10]), KEY)


def test_fuzz_a_thousand_random_and_mutated_frames():
    rng = random.Random(0)
    good = encode(*sample(), KEY)
    refused = 0
    for i in range(1000):
        if i % 3 == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
        elif i % 3 == 1:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] ^= rng.randrange(1, 256)  # a byte that differs
            data = bytes(data)
        else:
            cut = rng.randrange(len(good))
            data = good[:cut] + bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 50)))
        try:
            decode(data, KEY)
        except FrameError:
            refused += 1
    assert refused == 1000
