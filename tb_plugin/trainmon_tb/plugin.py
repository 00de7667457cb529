"""The TensorBoard plugin ``trainmon``: routes over the runs' own files (see ``tb_plugin/README.md``).

The plugin reads only the logdir's files (anomalies, statistics store, dumps, manifest); it never touches
``context.multiplexer`` and needs no ``--samples_per_plugin``, so it answers the same under both
``--load_fast`` modes. Every answer is JSON (or a dump file) with ``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import mimetypes
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from trainmon.run.records import STATS, Kind
from trainmon.run.timing import TIMES
from trainmon_tb import metadata, params
from trainmon_tb.anomaly_index import json_number
from trainmon_tb.compare_view import CompareView
from trainmon_tb.params import BadRequest, Forbidden, NotFound
from trainmon_tb.paths import PathRefused, confined
from trainmon_tb.runs import Run, RunRegistry
from trainmon_tb.shape_index import UNKNOWN, Meta

logger = logging.getLogger("trainmon")

STATIC_DIR = Path(__file__).parent / "static"
MAX_BINS = 4000
MAX_EVENTS = 5000
MAX_SERIES_POINTS = 4000
# the time heat map's bins at most (a request for more gets these: its cells cost what they hold)
MAX_TIME_BINS = 2000
MAX_REQUEST_BYTES = 64 * 1024
_JSON = "application/json"
_KINDS = tuple(k.value for k in Kind)


# Answers larger than this are gzipped here at level 1 (TensorBoard gzips at level 3: twice the time for the
# base64 of the heat maps' floats, which barely compress either way)
_FAST_GZIP_BYTES = 256 * 1024


def _respond(request: wrappers.Request, payload: Any, code: int = 200) -> wrappers.Response:
    body = json.dumps(payload, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    content_type = f"{_JSON}; charset=utf-8"
    if len(body) > _FAST_GZIP_BYTES and request.accept_encodings["gzip"] > 0:
        data = gzip.compress(body.encode("utf-8"), compresslevel=1, mtime=0)
        return http_util.Respond(request, data, content_type, code=code, content_encoding="gzip")
    return http_util.Respond(request, body, content_type, code=code)


def _route(handler: Callable[..., Any]) -> Callable[..., Any]:
    """A werkzeug app from a handler returning a payload (or a Response); errors become JSON answers."""

    @wrappers.Request.application
    def app(self, request: wrappers.Request) -> wrappers.Response:
        start = time.perf_counter()
        response = _answer(self, request)
        # the time in this process, JSON and gzip included: a browser shows it beside the request
        # (Server-Timing; bench/plugin_first_view.py reads it from the tab's Resource Timing entries)
        response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - start) * 1e3:.1f}"
        return response

    def _answer(self, request: wrappers.Request) -> wrappers.Response:
        try:
            result = handler(self, request)
        except (BadRequest, PathRefused) as e:
            return _respond(request, {"error": str(e)}, 400)
        except Forbidden as e:
            return _respond(request, {"error": str(e)}, 403)
        except NotFound as e:
            return _respond(request, {"error": str(e)}, 404)
        except Exception as e:  # a bug here must answer, not hang the tab
            logger.exception("trainmon: %s failed", request.path)
            return _respond(request, {"error": f"internal error: {type(e).__name__}: {e}"}, 500)
        return result if isinstance(result, wrappers.Response) else _respond(request, result)

    app.__name__ = handler.__name__
    return app


def _filters(args) -> dict[str, Any]:
    """The anomaly filters shared by the timeline and the event list."""
    return {
        "kinds": params.names(args, "kinds"),
        "rules": params.names(args, "rules"),
        "name": params.text(args, "name"),
        "ranks": params.integers(args, "ranks"),
    }


def _b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def _stat_shapes(run: Run, rank: int | None, kind: str, names: list[str], stat: str) -> list[Meta]:
    """The (dtype, shape) of tensors of the statistics views (the heat map's rows, the series): a tensor its
    rank's first step lacks is looked up at the first step the matrix of ``stat`` has of it."""
    if rank is None:
        return [UNKNOWN] * len(names)
    return run.shapes.lookup(
        [(rank, kind, name) for name in names],
        lambda tensor: run.stats.first_step(tensor[0], stat, tensor[1], tensor[2]),
    )


def _event_shapes(run: Run, events: list[dict[str, Any]]) -> None:
    """Adds each listed anomaly's tensor's ``shape`` and ``dtype`` (None where the store has none: a tensor
    without statistics; records of no tensor, kind ``*`` or ``time``: a summary line of the per-step cap, a
    skipped step, a straggler); a tensor its rank's first step lacks is looked up at the anomaly's step."""
    named = [e for e in events if e.get("kind") in _KINDS]
    tensors = [(int(e["rank"]), str(e["kind"]), str(e["name"])) for e in named]
    steps = dict(zip(tensors, (int(e["step"]) for e in named), strict=True))
    found = dict(zip(tensors, run.shapes.lookup(tensors, steps.get), strict=True))
    for e in events:
        e["dtype"], e["shape"] = found.get((e["rank"], e["kind"], e["name"]), UNKNOWN)


class TrainmonPlugin(base_plugin.TBPlugin):
    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        flags = context.flags
        self.allow_dump_requests = bool(getattr(flags, metadata.FLAG_ALLOW_DUMP_REQUESTS, False))
        poll_secs = getattr(flags, metadata.FLAG_POLL_SECS, None) or metadata.DEFAULT_POLL_SECS
        self.registry = RunRegistry(context.logdir or None, poll_secs)
        self.registry.start()
        self.comparisons = CompareView()

    # ------------------------------------------------------------------ TBPlugin
    def get_plugin_apps(self) -> dict[str, Callable]:
        return {
            "/static/*": self._static,
            "/runs": self._runs,
            "/timeline": self._timeline,
            "/events": self._events,
            "/heatmap": self._heatmap,
            "/series": self._series,
            "/time_heatmap": self._time_heatmap,
            "/rank_steps": self._rank_steps,
            "/dump_meta": self._dump_meta,
            "/dump": self._dump,
            "/request_dump": self._request_dump,
            "/compare": self._compare,
            "/compare_dumps": self._compare_dumps,
        }

    def is_active(self) -> bool:
        return self.registry.has_runs()

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        # the tab refreshes itself (TensorBoard's reload message, and a timer while "live" is on)
        return base_plugin.FrontendMetadata(es_module_path="/static/index.js", tab_name=metadata.TAB_NAME)

    # ------------------------------------------------------------------ static files
    def _serve_file(self, request: wrappers.Request, relative: str) -> wrappers.Response:
        path = confined(STATIC_DIR, relative, "static file")
        if not path.is_file():
            raise NotFound(f"no static file {relative!r}")
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if path.suffix == ".js":
            content_type = "text/javascript"
        return http_util.Respond(request, path.read_bytes(), content_type)

    @_route
    def _static(self, request: wrappers.Request) -> wrappers.Response:
        prefix = "/static/"
        path = request.path
        relative = path[path.index(prefix) + len(prefix) :] if prefix in path else ""
        return self._serve_file(request, relative)

    # ------------------------------------------------------------------ helpers
    def _run(self, request: wrappers.Request) -> Run:
        key = params.required(request.args, "run")
        if self.registry.logdir is None:
            raise NotFound("TensorBoard was started without --logdir")
        confined(self.registry.logdir, key, "run")  # refuses traversal before any lookup
        run = self.registry.get(key)
        if run is None:
            raise NotFound(f"no trainmon run {key!r} under the logdir")
        return run

    def _step_range(self, request: wrappers.Request, run: Run) -> tuple[int, int]:
        lo = params.integer(request.args, "step_lo")
        hi = params.integer(request.args, "step_hi")
        if lo is None or hi is None:
            known = run.summary()["steps"] or [0, 0]
            lo = known[0] if lo is None else lo
            hi = known[1] if hi is None else hi
        if hi < lo:
            raise BadRequest(f"step_hi ({hi}) is below step_lo ({lo})")
        return lo, hi

    def _dump_path(self, request: wrappers.Request, run: Run) -> tuple[str, Path]:
        relative = params.required(request.args, "path")
        path = confined(run.dir, relative, "path")
        if path.suffix != ".safetensors":
            raise BadRequest(f"path {relative!r}: only .safetensors dumps are served")
        if not path.is_file():
            raise NotFound(f"no dump {relative!r} in run {run.id!r}")
        return relative, path

    # ------------------------------------------------------------------ data routes
    @_route
    def _runs(self, request: wrappers.Request) -> dict[str, Any]:
        runs = []
        for _key, run in sorted(self.registry.scan().items()):
            run.refresh(1.0, wait=not run.loaded.is_set())  # the poller's refresh is never waited for
            runs.append({**run.summary(), "damaged": run.damaged()})
        return {
            "runs": runs,
            "stats": list(STATS),
            "times": list(TIMES),
            "allow_dump_requests": self.allow_dump_requests,
        }

    @_route
    def _timeline(self, request: wrappers.Request) -> dict[str, Any]:
        args = request.args
        run = self._run(request)
        axis = params.choice(args, "axis", ("rank", "module"), "rank")
        bins = params.integer(args, "bins", 400, 1, MAX_BINS)
        # while live, the tab sends the key of its last answer: when nothing changed, nothing is sent again
        key = run.timeline_key()
        if params.text(args, "since") == key:
            return {"run": run.id, "unchanged": True, "key": key}
        lo, hi = self._step_range(request, run)
        expand = params.integers(args, "expand")
        t = run.anomalies.timeline(
            axis,
            lo,
            hi,
            bins,
            all_ranks=run.summary()["ranks"],
            expand=expand,
            interval=run.interval,
            **_filters(args),
        )
        out = {"run": run.id, "key": key, **t.__dict__, "damaged": run.damaged()}
        if len(run.dumps):  # the tab shows a run with dumps: make the first one opened open at once
            from trainmon_tb.dump_view import warm_up

            warm_up()
        if out["first"] is not None:
            out["first"] = {k: json_number(v) if isinstance(v, float) else v for k, v in out["first"].items()}
        return out

    @_route
    def _events(self, request: wrappers.Request) -> dict[str, Any]:
        args = request.args
        run = self._run(request)
        lo, hi = params.integer(args, "step_lo"), params.integer(args, "step_hi")
        if lo is None and hi is None:
            lo, hi = self._step_range(request, run)
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if hi < lo:
            raise BadRequest(f"step_hi ({hi}) is below step_lo ({lo})")
        limit = params.integer(args, "limit", 200, 1, MAX_EVENTS)
        offset = params.integer(args, "offset", 0, 0)
        total, events = run.anomalies.events(lo, hi, limit=limit, offset=offset, **_filters(args))
        for e in events:
            e["dumps"], e["dump_step"] = run.dumps.for_anomaly(e)
        _event_shapes(run, events)
        return {"total": total, "offset": offset, "events": events}

    def _kind_stat(self, request: wrappers.Request) -> tuple[str, str]:
        kind = params.choice(request.args, "kind", _KINDS)
        stat = params.choice(request.args, "stat", STATS, "norm")
        return kind, stat

    @_route
    def _heatmap(self, request: wrappers.Request) -> dict[str, Any]:
        args = request.args
        run = self._run(request)
        kind, stat = self._kind_stat(request)
        rank = params.integer(args, "rank", None, 0)
        bins = params.integer(args, "bins", 1000, 1, MAX_BINS)
        lo, hi = params.integer(args, "step_lo"), params.integer(args, "step_hi")
        if lo is not None and hi is not None and hi < lo:
            raise BadRequest(f"step_hi ({hi}) is below step_lo ({lo})")
        # while live, the tab sends the key of its last answer: when the rank's store was not written since,
        # nothing is computed or sent again (a finished run's heatmap is never sent twice)
        key = run.stats.key(rank)
        if key is not None and params.text(args, "since") == key:
            return {"run": run.id, "unchanged": True, "key": key}
        hm = run.stats.heatmap(rank, kind, stat, lo, hi, bins, name=params.text(args, "name"))
        if hm is None:
            raise NotFound(f"run {run.id!r} has no statistics for rank {rank}")
        finite = hm.values[np.isfinite(hm.values)]
        magnitude = np.abs(finite)
        positive = magnitude[magnitude > 0]
        rank = rank if rank is not None else run.stats.first_rank()
        metas = _stat_shapes(run, rank, kind, hm.names, stat)
        return {
            "run": run.id,
            "key": key,
            "rank": rank,
            "kind": kind,
            "stat": stat,
            "agg": hm.agg,
            "names": hm.names,
            # each row's tensor as the store recorded it, once a name (texts such as "[256, 64]", "float32")
            "shapes": [shape for _, shape in metas],
            "dtypes": [dtype for dtype, _ in metas],
            "step_lo": hm.step_lo,
            "step_hi": hm.step_hi,
            "bins": hm.bins,
            "edges": hm.edges,
            "values": _b64(hm.values, "<f4"),
            "flags": _b64(hm.flags, "u1"),
            # the cells whose tensor held NaN/Inf: their most NaN and Inf elements at one step of the bin
            "nonfinite": {
                "cells": hm.bad_cells.tolist(),
                "nans": hm.bad_nans.tolist(),
                "infs": hm.bad_infs.tolist(),
            },
            "finite_range": [
                float(positive.min()) if positive.size else None,
                float(magnitude.max()) if magnitude.size else None,
            ],
            "damaged": run.damaged(),
        }

    @_route
    def _series(self, request: wrappers.Request) -> dict[str, Any]:
        args = request.args
        run = self._run(request)
        kind, stat = self._kind_stat(request)
        name = params.required(args, "name")
        rank = params.integer(args, "rank", None, 0)
        found = run.stats.series(rank, kind, name, stat)
        if found is None:
            raise NotFound(f"no statistics of {kind} {name!r} on rank {rank} in run {run.id!r}")
        steps, values = found
        rank = rank if rank is not None else run.stats.first_rank()
        markers = run.anomalies.markers(rank, kind, name)
        nan_steps, inf_steps = run.stats.nonfinite_steps(rank, kind, name, stat)
        ((dtype, shape),) = _stat_shapes(run, rank, kind, [name], stat)
        return {
            "shape": shape,
            "dtype": dtype,
            "steps": steps.tolist(),
            "values": [json_number(float(v)) for v in values],
            # the steps where the tensor held NaN (Inf) elements: the value there is of its finite ones only
            "nan_steps": nan_steps,
            "inf_steps": inf_steps,
            "anomalies": [
                {k: json_number(v) if isinstance(v, float) else v for k, v in m.items()} for m in markers
            ],
            "damaged": run.damaged(),
        }

    @_route
    def _time_heatmap(self, request: wrappers.Request) -> dict[str, Any]:
        args = request.args
        run = self._run(request)
        name = params.choice(args, "time", TIMES, "step")
        bins = min(MAX_TIME_BINS, params.integer(args, "bins", 1000, 1, MAX_BINS))
        lo, hi = params.integer(args, "step_lo"), params.integer(args, "step_hi")
        if lo is not None and hi is not None and hi < lo:
            raise BadRequest(f"step_hi ({hi}) is below step_lo ({lo})")
        # while live, the tab sends the key of its last answer: when nothing was written since, nothing is
        # computed or sent again
        key = run.times.key(name)
        if key is not None and params.text(args, "since") == key:
            return {"run": run.id, "unchanged": True, "key": key}
        hm = run.times.heatmap(name, lo, hi, bins, params.integers(args, "expand") or ())
        if hm is None or key is None:
            damaged = "; ".join(f"{d['path']}: {d['why']}" for d in run.damaged())
            why = f"; damaged: {damaged}" if damaged else ""
            raise NotFound(f"run {run.id!r} has no timing tables (timing: enable, docs/timing.md){why}")
        ranges = {}
        for agg, values in (("median", hm.median), ("max", hm.max)):
            finite = values[np.isfinite(values)]
            positive = finite[finite > 0]
            ranges[agg] = [
                float(positive.min()) if positive.size else None,
                float(finite.max()) if finite.size else None,
            ]
        return {
            "run": run.id,
            "key": key,
            "time": name,
            "unit": "ms",
            "source": hm.source,
            "rows": hm.labels,
            "row_kinds": hm.row_kinds,
            "group_size": hm.group_size,
            "rows_total": hm.ranks,
            "step_lo": hm.step_lo,
            "step_hi": hm.step_hi,
            "bins": hm.bins,
            "edges": hm.edges,
            "median": _b64(hm.median, "<f4"),
            "max": _b64(hm.max, "<f4"),
            "max_rank": _b64(hm.max_rank, "<i4"),
            "flags": _b64(hm.flags, "u1"),
            "ranges": ranges,
            "damaged": run.damaged(),
        }

    @_route
    def _rank_steps(self, request: wrappers.Request) -> dict[str, Any]:
        from trainmon_tb.rank_view import rank_steps

        args = request.args
        run = self._run(request)
        rank = params.integer(args, "rank", None, 0)
        if rank is None:
            raise BadRequest("parameter 'rank' is required")
        points = params.integer(args, "points", 1000, 1, MAX_SERIES_POINTS)
        lo, hi = params.integer(args, "step_lo"), params.integer(args, "step_hi")
        if lo is not None and hi is not None and hi < lo:
            raise BadRequest(f"step_hi ({hi}) is below step_lo ({lo})")
        found = rank_steps(run.dir, rank, lo, hi, points)
        if not found.timed_steps and found.grad_norm is None:
            raise NotFound(f"no timing or steps table of rank {rank} in run {run.id!r}")

        def numbers(values) -> list:
            return [json_number(float(v)) for v in values]

        return {
            "run": run.id,
            "rank": rank,
            "unit": "ms",
            "steps": found.steps.tolist(),
            "edges": found.edges,
            "times": {name: numbers(v) for name, v in found.times.items()},
            "timed_steps": found.timed_steps,
            "numerics": None
            if found.grad_norm is None
            else {
                "steps": found.grad_norm_steps.tolist(),
                "edges": found.numeric_edges,
                "grad_norm": numbers(found.grad_norm),
                "anomalies": [int(a) for a in found.anomalies],
            },
            "damaged": run.damaged(),
        }

    @_route
    def _dump_meta(self, request: wrappers.Request) -> dict[str, Any]:
        from trainmon.run.dumps import DumpError
        from trainmon_tb.dump_view import describe

        run = self._run(request)
        relative, path = self._dump_path(request, run)
        try:
            details = describe(path)
        except DumpError as e:
            raise BadRequest(str(e).replace(str(path), relative)) from None
        entry = run.dumps.entry(relative)
        return {
            "path": relative,
            "entry": entry.to_dict() if entry else None,
            **details,
            # the other tensors of the same module call: its inputs next to its outputs
            "module": run.dumps.module_call(entry) if entry else None,
        }

    @_route
    def _dump(self, request: wrappers.Request) -> wrappers.Response:
        run = self._run(request)
        relative, path = self._dump_path(request, run)
        filename = path.name.replace('"', "")
        return http_util.Respond(
            request,
            path.read_bytes(),
            "application/octet-stream",
            headers=[("Content-Disposition", f'attachment; filename="{filename}"')],
        )

    def _runs_of(self, fields) -> tuple[Run, Run]:
        """The two runs of a comparison (parameters ``run_a``, ``run_b``)."""
        if self.registry.logdir is None:
            raise NotFound("TensorBoard was started without --logdir")
        found = []
        for name in ("run_a", "run_b"):
            key = params.required(fields, name)
            confined(self.registry.logdir, key, name)  # refuses traversal before any lookup
            run = self.registry.get(key)
            if run is None:
                raise NotFound(f"no trainmon run {key!r} under the logdir")
            found.append(run)
        return found[0], found[1]

    @_route
    def _compare(self, request: wrappers.Request) -> dict[str, Any]:
        args = request.args
        run_a, run_b = self._runs_of(args)
        rank = params.integer(args, "rank", None, 0)
        bins = params.integer(args, "bins", 1000, 1, MAX_BINS)
        return self.comparisons.answer(run_a, run_b, rank, bins)

    @_route
    def _compare_dumps(self, request: wrappers.Request) -> dict[str, Any]:
        body = self._dump_request_body(request, ("run_a", "run_b", "rank", "bins"))
        run_a, run_b = self._runs_of(body)
        rank = params.integer(body, "rank", None, 0)
        bins = params.integer(body, "bins", 1000, 1, MAX_BINS)
        return self.comparisons.request_dumps(run_a, run_b, rank, bins)

    def _dump_request_body(self, request: wrappers.Request, allowed: tuple[str, ...]) -> dict[str, str]:
        """The JSON body of a POST that files dump requests, its fields as text (checks shared by the routes
        that write into runs' requests.jsonl)."""
        route = request.path.rsplit("/", 1)[-1]
        if request.method != "POST":
            raise BadRequest(f"{route} takes a POST with a JSON body")
        if not self.allow_dump_requests:
            raise Forbidden(
                f"dump requests are off: start TensorBoard with --{metadata.FLAG_ALLOW_DUMP_REQUESTS} "
                "to allow them (TensorBoard has no authentication)"
            )
        # a JSON content type cannot be sent cross-site without a CORS preflight, which TensorBoard refuses
        if request.mimetype != _JSON:
            raise BadRequest(f"{route} needs Content-Type: application/json")
        if (request.content_length or 0) > MAX_REQUEST_BYTES:
            raise BadRequest("request body too large")
        try:
            body = json.loads(request.get_data(as_text=True))
        except ValueError as e:
            raise BadRequest(f"request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise BadRequest(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return {k: "" if v is None else str(v) for k, v in body.items()}

    @_route
    def _request_dump(self, request: wrappers.Request) -> dict[str, Any]:
        from trainmon.run.dumps import DumpRequest, append_request

        fields = self._dump_request_body(request, ("run", "name", "kind", "rank", "step"))
        run_key = params.required(fields, "run")
        if self.registry.logdir is None:
            raise NotFound("TensorBoard was started without --logdir")
        confined(self.registry.logdir, run_key, "run")
        run = self.registry.get(run_key)
        if run is None:
            raise NotFound(f"no trainmon run {run_key!r} under the logdir")
        name = params.required(fields, "name")
        kind = params.choice(fields, "kind", _KINDS) if fields.get("kind") else None
        step, rank = params.integer(fields, "step", None, 0), params.integer(fields, "rank", None, 0)
        try:
            dump_request = DumpRequest.new(name, step=step, rank=rank, kind=kind)
        except ValueError as e:  # a blank name
            raise BadRequest(f"parameter 'name': {e}") from None
        append_request(run.dir, dump_request)
        return {"id": dump_request.id}
