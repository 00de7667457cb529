"""What goes over the writer process's pipes, and how it is framed (:mod:`trainmon.writer.process` speaks for
the training process, :mod:`trainmon.writer.child` for the writer process).

Training process -> writer process (the child's stdin): frames of a kind byte, a session (one monitor's
outputs) and a 4-byte body length::

    O  open     JSON: the session's sinks (``SinkSpec.to_json``), the manifest's payload, the rank whose step
                log (steps table, timing tables, summary) it keeps or null, the parent's clock
    L  layout   JSON: a layout id and its rows: kind, name, vpp_stage, micro_step, phase, shape, dtype (text)
    K  keys     JSON: an id and the tensors (kind, vpp_stage, name) of an all_ranks table
    S  step     binary, below
    E  end      binary: a step's end as the rank's step log records it (``StepEnd``, below)
    A  records  JSON: anomaly records the training process wrote (``trainmon.run.anomalies``), which the
                rank's summary counts
    F  flush    JSON: an id, answered when everything before it is written and flushed
    W  follow   JSON: a config edit's outputs and manifest, in order with the steps
    C  close    JSON: the parent's clock; the child closes every sink of the session

A step's body is a fixed header (step, rank, wall time, flags, layout id, rows, keys id, keys rows, bytes of
the skip reason, the timed step, this rank's place among the timed ranks, the timed ranks), then the
partials (rows x 8 float64), the collectives (rows int64), this rank's own NaN + Inf counts of the rows
(rows float64, for steps that merged rows over ranks), the all_ranks partials (keys rows x 8 float64)
and the step's times (this rank's row, then every rank's: ``trainmon.run.timing``, float64) where the flags
say so, then the skip reason (UTF-8): every array starts 8-byte aligned in the body. A layout goes once,
when a step first has it; a step names it by id. A step's end (step, wall time, gradient norm, its NaN and
Inf elements, tensors, records, skipped) follows the step it ends; the step log takes that step's times
from it.

Writer process -> training process (the child's stdout): frames of a 4-byte length and a JSON object with
``"t"`` and its session ``"s"``: ``opened``, ``failed`` (why, the errno of an ``OSError``), ``ack`` (a
flush's id), ``followed``, ``closed``; and ``log`` (a log record of the child, which the parent logs again).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import numpy as np

from trainmon.anomaly.steplog import StepEnd
from trainmon.run.anomalies import anomaly_from_json, anomaly_to_json
from trainmon.run.records import N_PARTIALS, Anomaly, RankAggregate, Row, StepRecord
from trainmon.run.timing import WIDTH, StepTiming

__all__ = [
    "CLOSE",
    "END",
    "FLUSH",
    "FOLLOW",
    "FRAME",
    "KEYS",
    "LAYOUT",
    "OPEN",
    "RECORDS",
    "REPLY",
    "STEP",
    "decode_end",
    "decode_keys",
    "decode_records",
    "decode_rows",
    "decode_step",
    "encode_end",
    "encode_keys",
    "encode_records",
    "encode_rows",
    "encode_step",
    "json_frame",
    "reply",
]

OPEN, LAYOUT, KEYS, STEP, END, RECORDS = b"O", b"L", b"K", b"S", b"E", b"A"
FLUSH, FOLLOW, CLOSE = b"F", b"W", b"C"

FRAME = struct.Struct("<cII")  # kind, session, body length
REPLY = struct.Struct("<I")  # body length
# step, rank, wall_time, flags, layout id, rows, keys id, keys rows, reason bytes, timed step, timing index,
# timed ranks; padded to 64 bytes
_STEP_HEAD = struct.Struct("<qidB3xIIiII4xqiI")
_STEP_FRAME = struct.Struct(FRAME.format + _STEP_HEAD.format[1:])
_SKIPPED, _COLLECTIVES, _ALL_RANKS, _TIMING, _OWN = 1, 2, 4, 8, 16
_ROW_BYTES = N_PARTIALS * 8
# step, wall_time, grad_norm, grad_nonfinite, tensors, anomalies, skipped
_END = struct.Struct("<qdddii?")
_END_FRAME = struct.Struct(FRAME.format + _END.format[1:])


def json_frame(kind: bytes, session: int, body: Mapping[str, Any]) -> bytes:
    """A frame of ``kind`` holding ``body`` as JSON (any string, lone surrogates included, comes back
    whole)."""
    data = json.dumps(body, separators=(",", ":")).encode("ascii")
    return FRAME.pack(kind, session, len(data)) + data


def reply(body: Mapping[str, Any]) -> bytes:
    """A frame of the writer process's answers."""
    data = json.dumps(body, separators=(",", ":")).encode("ascii")
    return REPLY.pack(len(data)) + data


# -- layouts -------------------------------------------------------------------------------------------------


def _text(value: object) -> str:
    return str(value.value) if isinstance(value, Enum) else str(value)


class _ShapeText(str):
    """A shape that is no sequence of sizes, as its text: the CSV writes it as it is (``format_shape``)."""

    def __iter__(self):
        raise TypeError("not a shape")


def _shape(shape: object) -> list[int] | dict[str, str]:
    try:
        return [int(d) for d in shape]  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return {"text": str(shape)}


def encode_rows(session: int, layout: int, rows: tuple[Row, ...]) -> bytes:
    """The layout frame: what the sinks read of the rows (the dtype as its text, which is what the CSV
    writes), sent once per layout."""
    body = [
        [_text(r.kind), str(r.name), int(r.vpp_stage), int(r.micro_step), _text(r.phase), _shape(r.shape),
         str(r.dtype)]
        for r in rows
    ]  # fmt: skip
    return json_frame(LAYOUT, session, {"id": layout, "rows": body})


def decode_rows(body: Mapping[str, Any]) -> tuple[int, tuple[Row, ...]]:
    rows = []
    for kind, name, vpp, micro, phase, shape, dtype in body["rows"]:
        size = _ShapeText(shape["text"]) if isinstance(shape, dict) else tuple(shape)
        rows.append(Row(kind, name, vpp, micro, phase, size, dtype))
    return int(body["id"]), tuple(rows)


def encode_keys(session: int, keys_id: int, keys: tuple[tuple[str, int, str], ...]) -> bytes:
    return json_frame(
        KEYS, session, {"id": keys_id, "keys": [[_text(k), int(v), str(n)] for k, v, n in keys]}
    )


def decode_keys(body: Mapping[str, Any]) -> tuple[int, tuple[tuple[str, int, str], ...]]:
    return int(body["id"]), tuple((str(k), int(v), str(n)) for k, v, n in body["keys"])


# -- steps ---------------------------------------------------------------------------------------------------


def encode_step(record: StepRecord, session: int, layout: int, keys_id: int) -> list:
    """The buffers of one step's frame, for one ``os.writev``: the arrays go as they are, uncopied."""
    partials = np.ascontiguousarray(record.partials, dtype=np.float64).reshape(-1, N_PARTIALS)
    # a step without statistics (its times only) has no partials: an empty array cannot go in a writev
    buffers: list = [b"", partials] if len(partials) else [b""]
    flags = _SKIPPED if record.skipped else 0
    size = partials.nbytes
    if record.collectives is not None:
        collectives = np.ascontiguousarray(record.collectives, dtype=np.int64).reshape(-1)
        buffers.append(collectives)
        size += collectives.nbytes
        flags |= _COLLECTIVES
    if record.own_nonfinite is not None and len(partials):
        own = np.ascontiguousarray(record.own_nonfinite, dtype=np.float64).reshape(-1)
        buffers.append(own)
        size += own.nbytes
        flags |= _OWN
    agg_rows = 0
    if record.all_ranks is not None:
        merged = np.ascontiguousarray(record.all_ranks.partials, dtype=np.float64).reshape(-1, N_PARTIALS)
        buffers.append(merged)
        agg_rows = len(merged)
        size += merged.nbytes
        flags |= _ALL_RANKS
    timing = record.timing
    timed_step, timed_index, timed_ranks = 0, 0, 0
    if timing is not None:
        own = np.ascontiguousarray(timing.own, dtype=np.float64).reshape(WIDTH)
        buffers.append(own)
        size += own.nbytes
        if timing.ranks is not None:
            ranks = np.ascontiguousarray(timing.ranks, dtype=np.float64).reshape(-1, WIDTH)
            buffers.append(ranks)
            size += ranks.nbytes
            timed_ranks = len(ranks)
        timed_step, timed_index = int(timing.step), int(timing.index)
        flags |= _TIMING
    reason = record.skip_reason.encode("utf-8", "surrogatepass") if record.skip_reason else b""
    if reason:
        buffers.append(reason)
        size += len(reason)
    buffers[0] = _STEP_FRAME.pack(
        STEP, session, _STEP_HEAD.size + size, int(record.step), int(record.rank), float(record.wall_time),
        flags, layout, len(partials), keys_id, agg_rows, len(reason), timed_step, timed_index, timed_ranks,
    )  # fmt: skip
    return buffers


def decode_step(
    body: bytearray,
    rows_of: Callable[[int], tuple[Row, ...]],
    keys_of: Callable[[int], tuple[tuple[str, int, str], ...]],
) -> tuple[StepRecord, int]:
    """The record of a step's body (its arrays are views of ``body``), and its layout id."""
    head = _STEP_HEAD.unpack_from(body, 0)
    step, rank, wall_time, flags, layout, n, keys_id, agg_rows, reason_len = head[:9]
    timed_step, timed_index, timed_ranks = head[9:]
    at = _STEP_HEAD.size
    partials = np.frombuffer(body, np.float64, n * N_PARTIALS, at).reshape(n, N_PARTIALS)
    at += n * _ROW_BYTES
    collectives = None
    if flags & _COLLECTIVES:
        collectives = np.frombuffer(body, np.int64, n, at)
        at += n * 8
    own = None
    if flags & _OWN:
        own = np.frombuffer(body, np.float64, n, at)
        at += n * 8
    all_ranks = None
    if flags & _ALL_RANKS:
        merged = np.frombuffer(body, np.float64, agg_rows * N_PARTIALS, at).reshape(agg_rows, N_PARTIALS)
        all_ranks = RankAggregate(keys_of(keys_id), merged)
        at += agg_rows * _ROW_BYTES
    timing = None
    if flags & _TIMING:
        own = np.frombuffer(body, np.float64, WIDTH, at)
        at += WIDTH * 8
        ranks = None
        if timed_ranks:
            ranks = np.frombuffer(body, np.float64, timed_ranks * WIDTH, at).reshape(timed_ranks, WIDTH)
            at += timed_ranks * WIDTH * 8
        timing = StepTiming(timed_step, timed_index, own, ranks)
    reason = bytes(body[at : at + reason_len]).decode("utf-8", "surrogatepass")
    record = StepRecord(
        step,
        rank,
        rows_of(layout),
        partials,
        wall_time,
        bool(flags & _SKIPPED),
        collectives,
        reason,
        all_ranks,
        timing,
        own,
    )
    return record, layout


# -- the step log --------------------------------------------------------------------------------------------


def encode_end(session: int, end: StepEnd) -> bytes:
    return _END_FRAME.pack(
        END, session, _END.size, end.step, end.wall_time, end.grad_norm, end.grad_nonfinite, end.tensors,
        end.anomalies, end.skipped,
    )  # fmt: skip


def decode_end(body: bytearray) -> StepEnd:
    return StepEnd(*_END.unpack(body))


def encode_records(session: int, recorded: list[Anomaly]) -> bytes:
    return json_frame(RECORDS, session, {"records": [anomaly_to_json(a) for a in recorded]})


def decode_records(body: Mapping[str, Any]) -> list[Anomaly]:
    return [anomaly_from_json(line) for line in body["records"]]
