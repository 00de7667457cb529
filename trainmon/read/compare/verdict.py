"""What the first divergent tensor says: which computation parted the runs, with the tensors that show it.

Everything before the first divergent tensor in its step agrees (that is what "first" means), so the question
is what the tensor is and what its neighbours at the same step say:

==================  ==============================================================================
cause               the first divergent tensor, and what agrees around it
==================  ==============================================================================
``data``            the first input of the step (nothing before it is recorded)
``forward``         a module's output, its inputs agreeing: the module's forward computation
``between_modules`` a module's input, every earlier output agreeing: computation no hook sees (a
                    functional op inside the enclosing module's forward, or data fed to the module)
``loss``            the first gradient of the backward (or a tracked scalar), the forward agreeing: the
                    loss function, its scaling, the labels
``backward``        a module's input gradient, its output gradient agreeing: the module's backward (also
                    a weight gradient whose module's input gradient differs as well)
``backward_between`` a module's output gradient, every earlier gradient agreeing: a functional op's
                    backward between hooked modules
``weight_gradient`` a weight gradient, its module's input and output gradient (and input gradient)
                    agreeing: the weight-gradient computation (dW) alone
``reduction``       a gradient after reduction, the same gradient before it agreeing: the
                    communication (or what runs between backward and the optimizer: clipping, unscaling)
``update``          parameters or Adam moments after the step, the gradient agreeing: the optimizer, its
                    hyper-parameters (which state differs tells beta1, beta2, or lr/eps/weight decay)
``parameters``      the parameters a step started from: initial weights, a checkpoint, or a change outside
                    the optimizer step
``collective``      a tensor a collective moved
==================  ==============================================================================

Every divergent tensor after the first is downstream: counted, never named as a cause.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmon.read.compare.engine import Result, StepRow
from trainmon.read.compare.source import RunInfo
from trainmon.read.compare.tensors import module_of
from trainmon.run.names import module_call
from trainmon.run.records import Kind, Phase

__all__ = ["STAGES", "Evidence", "Verdict", "judge"]

_K = Kind
# the classification each cause belongs to
STAGES = {
    "data": "forward",
    "forward": "forward",
    "between_modules": "forward",
    "loss": "backward",
    "backward": "backward",
    "backward_between": "backward",
    "weight_gradient": "weight-gradient",
    "reduction": "reduction",
    "update": "update",
    "parameters": "parameters",
    "collective": "collective",
    "unknown": "unknown",
}
DRIFT_SCORE = 0.5  # the previous step this close to the tolerance already: maybe accumulated drift


@dataclass(frozen=True)
class Evidence:
    """A tensor around the first divergence, at its step: what it is, and whether it agrees."""

    role: str  # e.g. "input of fc1", "weight gradient before reduction"
    kind: str
    name: str
    name_b: str
    agrees: bool
    rel: float
    score: float


@dataclass(frozen=True)
class Verdict:
    cause: str
    stage: str
    module: str | None
    summary: str
    evidence: tuple[Evidence, ...]
    drift: bool = False
    notes: tuple[str, ...] = ()


class _Step:
    """Lookups into the first divergent step's row."""

    def __init__(self, row: StepRow) -> None:
        self.row = row
        self.plan = row.plan

    def find(self, kind: str, name: str) -> int | None:
        return self.plan.index(kind, name)

    def agrees(self, p: int) -> bool:
        return not bool(self.row.score[p] > 1)

    def evidence(self, role: str, p: int) -> Evidence:
        pair = self.plan.pairs[p]
        return Evidence(
            role,
            pair.kind,
            pair.name,
            pair.name_b,
            self.agrees(p),
            float(self.row.rel[p]),
            float(self.row.score[p]),
        )

    def rows_of(self, kind: str, module: str, roles: tuple[str, ...], call: int) -> list[int]:
        out = []
        for p, pair in enumerate(self.plan.pairs):
            if pair.kind != kind:
                continue
            found = module_call(kind, pair.name)
            if found is not None and found.module == module and found.role in roles and found.call == call:
                out.append(p)
        return out

    def first_of(self, kind: str) -> int | None:
        return next((p for p, pair in enumerate(self.plan.pairs) if pair.kind == kind), None)

    def param_rows(self, kind: str, module: str) -> list[int]:
        return [
            p
            for p, pair in enumerate(self.plan.pairs)
            if pair.kind == kind and module_of(kind, pair.name) == module
        ]


def _enclosing(step: _Step, module: str, call: int) -> tuple[str | None, int | None]:
    """The innermost module around ``module`` whose input is recorded, and that input's pair."""
    parts = module.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:cut])
        inputs = step.rows_of(_K.ACTV.value, outer, ("input",), 0)
        if inputs:
            return outer, inputs[0]
    return None, None


def _forward(step: _Step, p: int) -> Verdict:
    pair = step.plan.pairs[p]
    call = module_call(pair.kind, pair.name)
    if call is None:
        return _unknown(step, p)
    module = call.module
    if call.role == "output" and not step.rows_of(_K.ACTV.value, module, ("input",), call.call):
        earlier = [q for q in range(p) if step.plan.pairs[q].kind == _K.ACTV.value]
        evidence = [step.evidence("the previous monitored activation", earlier[-1])] if earlier else []
        evidence.append(step.evidence(f"output of {module}", p))
        return Verdict(
            "forward",
            "forward",
            module,
            f"{module}'s forward, or what feeds it: its output differs while every monitored tensor before "
            "it agrees (its inputs are not recorded)",
            tuple(evidence),
        )
    if call.role == "output":
        inputs = step.rows_of(_K.ACTV.value, module, ("input",), call.call)
        evidence = [step.evidence(f"input of {module}", q) for q in inputs] + [
            step.evidence(f"output of {module}", p)
        ]
        if all(step.agrees(q) for q in inputs):
            return Verdict(
                "forward",
                "forward",
                module,
                f"{module}'s forward: its output differs while its input{'s' if len(inputs) != 1 else ''} "
                f"agree{'' if len(inputs) != 1 else 's'}",
                tuple(evidence),
            )
    first_input = step.first_of(_K.ACTV.value)
    if call.role == "input" and first_input == p:
        return Verdict(
            "data",
            "forward",
            module,
            f"the data: the step's first input ({pair.name}) differs; nothing before it is recorded",
            (step.evidence("first input of the step", p),),
        )
    earlier = [q for q in range(p) if step.plan.pairs[q].kind == _K.ACTV.value]
    evidence = []
    if earlier:
        evidence.append(step.evidence("the previous monitored activation", earlier[-1]))
    outer, outer_input = _enclosing(step, module, call.call)
    if outer_input is not None:
        evidence.append(step.evidence(f"input of {outer}", outer_input))
    evidence.append(step.evidence(f"{call.role} of {module}", p))
    where = f" inside {outer}'s forward" if outer is not None else ""
    return Verdict(
        "between_modules",
        "forward",
        outer or module,
        f"computation no hook sees{where}: {pair.name} differs while every monitored tensor before it "
        "agrees (a functional op, or an input fed to the module directly)",
        tuple(evidence),
    )


def _backward(step: _Step, p: int) -> Verdict:
    pair = step.plan.pairs[p]
    call = module_call(pair.kind, pair.name)
    if call is None:
        return _unknown(step, p)
    module = call.module
    if call.role == "input_grad":
        outputs = step.rows_of(_K.ACTV_GRAD.value, module, ("output_grad",), call.call)
        evidence = [step.evidence(f"output gradient of {module}", q) for q in outputs]
        evidence.append(step.evidence(f"input gradient of {module}", p))
        if all(step.agrees(q) for q in outputs):
            return Verdict(
                "backward",
                "backward",
                module,
                f"{module}'s backward: its input gradient differs while the gradient of its output agrees",
                tuple(evidence),
            )
    first_grad = step.first_of(_K.ACTV_GRAD.value)
    if first_grad == p:
        return Verdict(
            "loss",
            "backward",
            module,
            f"the loss: the first gradient of the backward ({pair.name}) differs while the whole forward "
            "agrees (the loss function, its scaling, the labels)",
            (step.evidence(f"output gradient of {module}", p),),
        )
    earlier = [q for q in range(p) if step.plan.pairs[q].kind == _K.ACTV_GRAD.value]
    evidence = [step.evidence("the previous monitored gradient", earlier[-1])] if earlier else []
    evidence.append(step.evidence(f"output gradient of {module}", p))
    outer, _ = _enclosing(step, module, call.call)
    where = f" inside {outer}" if outer is not None else ""
    return Verdict(
        "backward_between",
        "backward",
        outer or module,
        f"a backward no hook sees{where}: the gradient reaching {module} differs while every earlier "
        "gradient agrees",
        tuple(evidence),
    )


def _module_context(step: _Step, module: str) -> list[Evidence]:
    out = [step.evidence(f"input of {module}", q) for q in step.rows_of(_K.ACTV.value, module, ("input",), 0)]
    out += [
        step.evidence(f"output gradient of {module}", q)
        for q in step.rows_of(_K.ACTV_GRAD.value, module, ("output_grad",), 0)
    ]
    return out


def _weight_gradient(step: _Step, p: int, notes: list[str]) -> Verdict:
    pair = step.plan.pairs[p]
    module = module_of(pair.kind, pair.name) or pair.name
    context = _module_context(step, module)
    input_grads = step.rows_of(_K.ACTV_GRAD.value, module, ("input_grad",), 0)
    evidence = context + [step.evidence(f"input gradient of {module}", q) for q in input_grads]
    evidence.append(step.evidence("weight gradient", p))
    if not context:
        notes.append(
            f"{module}'s activations are not recorded (xy_distribution), so its backward cannot be told "
            "from its weight-gradient computation"
        )
    if any(not step.agrees(q) for q in input_grads):
        return Verdict(
            "backward",
            "backward",
            module,
            f"{module}'s backward: its weight gradient and its input gradient differ while its input "
            "and output gradient agree",
            tuple(evidence),
            notes=tuple(notes),
        )
    if any(not e.agrees for e in context):
        return Verdict(
            "weight_gradient",
            "weight-gradient",
            module,
            f"the weight gradient {pair.name} differs (its module's activations differ too)",
            tuple(evidence),
            notes=tuple(notes),
        )
    return Verdict(
        "weight_gradient",
        "weight-gradient",
        module,
        f"the weight-gradient computation of {module}: {pair.name}'s gradient differs while the "
        f"module's input, output gradient and input gradient agree",
        tuple(evidence),
        notes=tuple(notes),
    )


def _reduced(step: _Step, p: int, a: RunInfo, b: RunInfo) -> Verdict:
    pair = step.plan.pairs[p]
    before = step.find(_K.GRAD_UNREDUCED.value, pair.name)
    if before is not None:
        evidence = (
            step.evidence("gradient before reduction", before),
            step.evidence("gradient after reduction", p),
        )
        if step.agrees(before):
            return Verdict(
                "reduction",
                "reduction",
                module_of(pair.kind, pair.name),
                f"the reduction: {pair.name}'s gradient agrees before the data-parallel reduction and "
                "differs after it (the collective, or what runs between backward and the optimizer: "
                "clipping, unscaling)",
                evidence,
            )
        return _weight_gradient(step, before, [])
    notes = []
    unreduced = _K.GRAD_UNREDUCED.value
    if any(x.kind == unreduced and x.name == pair.name for x in step.plan.left_out):
        notes.append(
            "the gradients before reduction hold different things in the two runs (a different number of "
            "micro-batches' gradients a step), so they were not compared: the reduction cannot be told from "
            "the weight-gradient computation"
        )
        verdict = _weight_gradient(step, p, notes)
        return Verdict(
            "reduction",
            "reduction",
            verdict.module,
            f"{pair.name}'s gradient after reduction differs (before it: not comparable between the runs)",
            verdict.evidence,
            notes=tuple(notes),
        )
    missing = [
        run.name
        for run, tensors in ((a, step.plan.tensors_a), (b, step.plan.tensors_b))
        if not any(k == unreduced for k, _ in tensors)
    ]
    if a.world_size == 1 and b.world_size == 1:
        notes.append("gradients before reduction are not recorded in both runs; one rank each: no reduction")
        return _weight_gradient(step, p, notes)
    notes.append(
        f"gradients before reduction are not recorded in {' and '.join(missing) or 'both runs'}: the "
        "reduction cannot be told from the weight-gradient computation"
    )
    verdict = _weight_gradient(step, p, notes)
    return Verdict(
        "reduction",
        "reduction",
        verdict.module,
        f"{pair.name}'s gradient after reduction differs (before it: not recorded in both runs)",
        verdict.evidence,
        notes=tuple(notes),
    )


def _update(step: _Step, p: int) -> Verdict:
    pair = step.plan.pairs[p]
    evidence = []
    grad = step.find(_K.GRAD_REDUCED.value, pair.name)
    if grad is not None:
        evidence.append(step.evidence("gradient the optimizer used", grad))
    state = {}
    for kind in (_K.PARAM_UPDATED.value, _K.EXP_AVG.value, _K.EXP_AVG_SQ.value):
        q = step.find(kind, pair.name)
        if q is not None:
            state[kind] = q
            evidence.append(step.evidence(kind, q))
    differs = {k for k, q in state.items() if not step.agrees(q)}
    if _K.EXP_AVG.value in differs and _K.EXP_AVG_SQ.value in differs:
        hint = "both moments differ: beta1 and beta2, or the gradient scale the optimizer saw"
    elif _K.EXP_AVG.value in differs:
        hint = "the first moment (exp_avg) differs: beta1 (momentum)"
    elif _K.EXP_AVG_SQ.value in differs:
        hint = "the second moment (exp_avg_sq) differs: beta2"
    else:
        hint = "the parameter differs, the moments agree: learning rate, eps, weight decay, the update rule"
    agreeing = grad is None or step.agrees(grad)
    summary = (
        f"the optimizer update of {pair.name}: {hint}"
        if agreeing
        else f"the optimizer update of {pair.name} (its gradient differs as well): {hint}"
    )
    notes = () if grad is not None else ("the gradient after reduction is not recorded (wg_distribution)",)
    return Verdict("update", "update", module_of(pair.kind, pair.name), summary, tuple(evidence), notes=notes)


def _unknown(step: _Step, p: int) -> Verdict:
    pair = step.plan.pairs[p]
    return Verdict(
        "unknown", "unknown", None, f"{pair.kind} {pair.name} differs", (step.evidence(pair.kind, p),)
    )


def _diverging_parameters(step: _Step) -> list[int]:
    """The step's parameters (as it started) that diverge, in A's order."""
    return [
        q
        for q, pair in enumerate(step.plan.pairs)
        if pair.kind == _K.PARAM_ORIGIN.value and not step.agrees(q)
    ]


def judge(result: Result, a: RunInfo, b: RunInfo) -> Verdict | None:
    """The verdict on a comparison's first divergence (None when the runs never part)."""
    row = result.first
    if row is None:
        return None
    step = _Step(row)
    p = row.first_divergent()
    pair = row.plan.pairs[p]
    notes: list[str] = []
    kind = pair.kind
    if kind == _K.PARAM_ORIGIN.value:  # the state the step started from: before everything else of the step
        params = _diverging_parameters(step)
        shown = [p, *(q for q in params if q != p)][:3]
        first = row.step == min((t.step_lo for t in result.ranks if t.step_lo is not None), default=row.step)
        stored = min(list(a.first_step.values()) + list(b.first_step.values()), default=row.step)
        if first and row.step > stored:
            where = f"the first step compared: what happened before step {row.step} was not compared"
        elif first:
            where = "the initial weights (or the checkpoint both runs started from)"
        else:
            where = "a change of the parameters outside the optimizer step"
        verdict = Verdict(
            "parameters",
            "parameters",
            module_of(_K.PARAM_ORIGIN.value, step.plan.pairs[shown[0]].name),
            f"the parameters step {row.step} started from differ: {where}",
            tuple(step.evidence("parameter at the step's start", q) for q in shown),
        )
    elif kind == _K.ACTV.value:
        verdict = _forward(step, p)
    elif kind == _K.ACTV_GRAD.value:
        verdict = _backward(step, p)
    elif kind == _K.GRAD_UNREDUCED.value:
        verdict = _weight_gradient(step, p, notes)
    elif kind == _K.GRAD_REDUCED.value:
        verdict = _reduced(step, p, a, b)
    elif kind in (
        _K.PARAM_UPDATED.value,
        _K.EXP_AVG.value,
        _K.EXP_AVG_SQ.value,
        _K.UPDATE.value,
        _K.RATIO.value,
    ):
        verdict = _update(step, p)
    elif kind == _K.SCALAR.value:
        verdict = Verdict(
            "loss",
            "backward" if pair.phase == Phase.BACKWARD.value else "forward",
            None,
            f"the tracked scalar {pair.name} differs while every monitored tensor before it agrees",
            (step.evidence("scalar", p),),
        )
    elif kind == _K.COMM.value:
        verdict = Verdict(
            "collective",
            "collective",
            None,
            f"the collective's tensor {pair.name} differs",
            (step.evidence("collective", p),),
        )
    else:
        verdict = _unknown(step, p)
    drift = bool(row.previous_score == row.previous_score and row.previous_score >= DRIFT_SCORE)
    if drift:
        notes = [
            *verdict.notes,
            f"at the previous step the runs were at {row.previous_score:.0%} of the tolerance "
            "already: this may be drift accumulated over steps rather than one change",
        ]
        verdict = Verdict(
            verdict.cause,
            verdict.stage,
            verdict.module,
            verdict.summary,
            verdict.evidence,
            True,
            tuple(notes),
        )
    return verdict


def downstream(result: Result) -> dict[str, int]:
    """How much diverges after the first divergence: cells (step, tensor, rank), tensors, and the steps
    holding those cells (the first divergence's step counts when another tensor diverges there too)."""
    cells = sum(t.divergent_cells for t in result.ranks)
    tensors = len({k for t in result.ranks for k in t.pair_counts})
    first = result.first
    same_step = int(np.count_nonzero(first.score > 1)) - 1 if first is not None else 0
    steps = len(result.divergent_steps)
    if first is not None and same_step <= 0:
        others = any(
            first.step in s for t in result.ranks if t.rank != first.rank for s in t.divergent_step_list
        )
        steps -= 0 if others else 1
    return {
        "cells": max(cells - 1, 0),
        "tensors": max(tensors - 1, 0),
        "at_first_step": max(same_step, 0),
        "steps": max(steps, 0),
    }
