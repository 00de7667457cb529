"""The detailed stage of an alignment: tensor dumps of the first divergence, asked of both runs.

For the first divergent tensor the dumps are: the tensor itself, its module's inputs and outputs (and, for a
gradient, the module's activation gradients; for a parameter's tensor, every tensor of that parameter), at the
divergent step on the divergent rank, each run in its own spelling of the names. They are appended to each
run's ``requests.jsonl`` (:func:`trainmon.run.dumps.append_request`): a job running in (or started again in)
that run folder serves them when it reaches the step (docs/dumps.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainmon.read.compare.engine import StepRow
from trainmon.read.compare.tensors import PARAM_KINDS, module_of
from trainmon.read.compare.verdict import Verdict
from trainmon.run.dumps import DumpRequest, append_request
from trainmon.run.records import Kind

__all__ = ["DumpTarget", "dump_targets", "request_dumps"]

_CHUNK = re.compile(r"^\d+:")


@dataclass(frozen=True)
class DumpTarget:
    """One dump request for both runs: the kind (None: every kind) and the name glob in each run."""

    kind: str | None
    name_a: str
    name_b: str


def _plain(name: str) -> str:
    """A name as dump requests match it: without the statistics store's ``<chunk>:`` prefix."""
    return _CHUNK.sub("", name, count=1)


def _module_b(row: StepRow, module: str) -> str | None:
    for pair in row.plan.pairs:
        if module_of(pair.kind, pair.name) == module:
            return module_of(pair.kind, pair.name_b)
    return None


def dump_targets(row: StepRow, verdict: Verdict | None) -> list[DumpTarget]:
    """What to dump of the first divergence ``row.first_divergent()``."""
    pair = row.plan.pairs[row.first_divergent()]
    targets = [DumpTarget(pair.kind, _plain(pair.name), _plain(pair.name_b))]
    found = [module_of(pair.kind, pair.name), verdict.module if verdict else None]
    modules = [m for m in dict.fromkeys(found) if m]
    for module in modules:
        other = _module_b(row, module) or module
        kinds = [Kind.ACTV.value]
        if pair.kind != Kind.ACTV.value:
            kinds.append(Kind.ACTV_GRAD.value)
        targets += [DumpTarget(k, f"{_plain(module)}.*", f"{_plain(other)}.*") for k in kinds]
    if pair.kind in PARAM_KINDS:
        targets.append(DumpTarget(None, _plain(pair.name), _plain(pair.name_b)))
    return list(dict.fromkeys(targets))


def request_dumps(run_a, run_b, row: StepRow, verdict: Verdict | None) -> list[tuple[str, DumpRequest]]:
    """Append the dump requests of the first divergence to both runs; (run, request) of each."""
    out = []
    for target in dump_targets(row, verdict):
        for run, name in ((run_a, target.name_a), (run_b, target.name_b)):
            request = DumpRequest.new(name, step=row.step, rank=row.rank, kind=target.kind)
            append_request(run, request)
            out.append((str(run), request))
    return out
