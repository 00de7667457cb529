"""2-process gloo worker for tests/test_comm.py: every collective, sync and async, through trainmon's
collective collector; the reference is computed from the tensors themselves and from the dispatcher.

Usage: ``python comm_worker.py OUT_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Writes
``OUT_DIR/rank_<r>.json``:

- ``rows``: the recorded ``comm`` rows in order: name, the collectives counter when taken, partials;
- ``expected``: the same list built here: each tensor cloned right before the call (inputs) and right after
  the call returned or its work was waited (outputs), partials computed in float64 with numpy, and the
  number of calls made so far;
- ``merged`` / ``expected_merged``: per name, the step-level merge of the rows (``records.TensorGroups``) and
  the partials of the concatenation of every tensor recorded under that name;
- ``hook_calls`` / ``dispatch_calls``: per collective family, the calls the wrappers counted and the ``c10d``
  ops a ``TorchDispatchMode`` saw in the same region (a coalesced op counts once per tensor it carries).
"""

# the lambdas handed to io() run before the loop moves on, so late binding of loop variables is intended
# ruff: noqa: B023

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import reference_partials  # noqa: E402

from trainmon.collect import comm  # noqa: E402
from trainmon.config import CcDistribution  # noqa: E402
from trainmon.run.records import TensorGroups  # noqa: E402
from trainmon.step.buffer import StepBuffer  # noqa: E402
from trainmon.step.position import LoopPosition  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)

# dispatcher op -> the family of the user-level calls it carries
DISPATCH_FAMILY = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "reduce_": "reduce",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single",
    "gather_": "gather",
    "scatter_": "scatter",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "barrier": "barrier",
}
HOOK_FAMILY = {"isend": "send", "irecv": "recv", "all_reduce_coalesced": "all_reduce"}


class DispatchCount(TorchDispatchMode):
    """Counts c10d ops as the dispatcher sees them: the reference for what the wrappers must see."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::"):
            op = name.split("::", 1)[1]
            first = args[0] if args else None
            carried = len(first) if op.endswith("_coalesced_") and isinstance(first, (list, tuple)) else 1
            self.calls[DISPATCH_FAMILY.get(op, op)] += carried
        return func(*args, **(kwargs or {}))


def family_counts(calls: Counter[str]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for op, n in calls.items():
        out[HOOK_FAMILY.get(op, op)] += n
    return dict(out)


class Expect:
    """The reference rows, taken from the tensors the test itself passes to each collective."""

    def __init__(self, collector: comm.CommCollector) -> None:
        self.rows: list[tuple[str, int, list[float]]] = []
        self.arrays: dict[str, list[np.ndarray]] = {}
        self.collector = collector

    def take(self, name: str, tensors) -> None:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        a = np.concatenate([t.detach().double().reshape(-1).numpy().copy() for t in tensors])
        self.rows.append((name, self.collector.count(), reference_partials(a).tolist()))
        self.arrays.setdefault(name, []).append(a)


def values(rank: int, n: int, salt: int) -> torch.Tensor:
    """Integer-valued floats: every sum of them is exact, so merged statistics must match bit for bit."""
    return (torch.arange(n, dtype=torch.float32) * (rank + 2) + salt) % 7 - 3


def run(rank: int, world: int) -> dict:
    state, buffer = LoopPosition(), StepBuffer(1e-8)
    collector = comm.CommCollector(state, buffer, CcDistribution(enable=True, cc_pre_hook=True))
    buffer.count_collectives = collector.count
    collector.arm()
    comm._HUB.calls_by_op.clear()
    buffer._collectives_at_start = collector.count()
    ex = Expect(collector)
    other = 1 - rank
    pair = dist.new_group([0, 1])
    pair_label = comm.group_label(pair)

    def io(op: str, before, call, after, label: str = "world"):
        """Record the expected input before ``call`` and the expected output after it."""
        if before is not None:
            ex.take(f"{op}.{label}.input", before)
        result = call()
        if after is not None:
            ex.take(f"{op}.{label}.output", after())
        return result

    dispatch = DispatchCount()
    with dispatch:
        for async_op in (False, True):
            salt = 10 if async_op else 0

            def done(work):
                if async_op:
                    work.wait()

            # all_reduce, with a NaN and an Inf on rank 1
            t = values(rank, 9, salt)
            if rank == 1:
                t[2], t[5] = float("nan"), float("inf")
            io("all_reduce", t, lambda: done(dist.all_reduce(t, async_op=async_op)), lambda: t)
            # on a group of its own
            t = values(rank, 5, salt + 1)
            io(
                "all_reduce",
                t,
                lambda: done(dist.all_reduce(t, group=pair, async_op=async_op)),
                lambda: t,
                pair_label,
            )
            # broadcast: the input counts on the source only
            t = values(rank, 6, salt + 2)
            io(
                "broadcast",
                t if rank == 0 else None,
                lambda: done(dist.broadcast(t, src=0, async_op=async_op)),
                lambda: t,
            )
            # reduce: the output counts on the destination only
            t = values(rank, 4, salt + 3)
            io(
                "reduce",
                t,
                lambda: done(dist.reduce(t, dst=1, async_op=async_op)),
                (lambda: t) if rank == 1 else None,
            )
            # all_gather into a list
            t = values(rank, 3, salt + 4)
            out = [torch.zeros(3) for _ in range(world)]
            io("all_gather", t, lambda: done(dist.all_gather(out, t, async_op=async_op)), lambda: out)
            # the flat all-gathers: three names of one collective
            for fn in (dist.all_gather_into_tensor, dist._all_gather_base, dist.all_gather_single):
                t = values(rank, 4, salt + 5)
                flat = torch.zeros(4 * world)
                io(
                    "all_gather_into_tensor",
                    t,
                    lambda fn=fn: done(fn(flat, t, async_op=async_op)),
                    lambda: flat,
                )
            # the flat reduce-scatters
            for fn in (dist.reduce_scatter_tensor, dist._reduce_scatter_base, dist.reduce_scatter_single):
                t = values(rank, 2 * world, salt + 6)
                shard = torch.zeros(2)
                io(
                    "reduce_scatter_tensor",
                    t,
                    lambda fn=fn: done(fn(shard, t, async_op=async_op)),
                    lambda: shard,
                )
            # all_to_all_single
            t = values(rank, 2 * world, salt + 7)
            got = torch.zeros(2 * world)
            io(
                "all_to_all_single",
                t,
                lambda: done(dist.all_to_all_single(got, t, async_op=async_op)),
                lambda: got,
            )
            # gather / scatter: the list counts on the root only
            t = values(rank, 3, salt + 8)
            bucket = [torch.zeros(3) for _ in range(world)] if rank == 0 else None
            io(
                "gather",
                t,
                lambda: done(dist.gather(t, bucket, dst=0, async_op=async_op)),
                (lambda: bucket) if rank == 0 else None,
            )
            pieces = [values(rank, 3, salt + 9 + i) for i in range(world)] if rank == 0 else None
            got3 = torch.zeros(3)
            io(
                "scatter",
                pieces,
                lambda: done(dist.scatter(got3, pieces, src=0, async_op=async_op)),
                lambda: got3,
            )
            # point to point: rank 0 sends, rank 1 receives
            t = values(rank, 5, salt + 11) if rank == 0 else torch.zeros(5)
            if async_op:
                if rank == 0:
                    io("isend", t, lambda: dist.isend(t, dst=1).wait(), None)
                else:
                    io("irecv", None, lambda: dist.irecv(t, src=0).wait(), lambda: t)
            elif rank == 0:
                io("send", t, lambda: dist.send(t, dst=1), None)
            else:
                io("recv", None, lambda: dist.recv(t, src=0), lambda: t)

        # coalescing manager blocks (what Megatron's buffers issue): outputs valid at exit / cm.wait()
        for async_ops in (False, True):
            ts = [values(rank, 3, 30 + i) for i in range(3)]
            with dist.distributed_c10d._coalescing_manager(async_ops=async_ops) as cm:
                for t in ts:
                    ex.take("all_reduce.world.input", t)
                    dist.all_reduce(t)
            if async_ops:
                cm.wait()
            for t in ts:
                ex.take("all_reduce.world.output", t)
            ins = [values(rank, 2, 40 + i) for i in range(2)]
            outs = [torch.zeros(2 * world) for _ in ins]
            with dist.distributed_c10d._coalescing_manager(async_ops=async_ops) as cm:
                for o, i in zip(outs, ins, strict=True):
                    ex.take("all_gather_into_tensor.world.input", i)
                    dist.all_gather_into_tensor(o, i)
            if async_ops:
                cm.wait()
            for o in outs:
                ex.take("all_gather_into_tensor.world.output", o)
    main_hooks = Counter(comm._HUB.calls_by_op)

    # user calls that the dispatcher sees as several ops (or one op carrying several tensors)
    special = DispatchCount()
    with special:
        # the public coalesced API: one call, one dispatcher op carrying 2 tensors
        ts = [values(rank, 3, 20), values(rank, 2, 21)]
        io("all_reduce_coalesced", ts, lambda: dist.all_reduce_coalesced(ts), lambda: ts)
        # batch_isend_irecv: a ring exchange in both directions
        send_t, recv_t = values(rank, 4, 22), torch.zeros(4)
        ops = [dist.P2POp(dist.isend, send_t, other), dist.P2POp(dist.irecv, recv_t, other)]

        def batch():
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        io("batch_isend_irecv", [send_t], batch, lambda: [recv_t])
        # object collectives and barriers are counted, with no statistics
        objects: list = [None] * world
        dist.all_gather_object(objects, {"rank": rank})
        dist.barrier()

    record, ready = buffer.finish(0, rank)
    if ready is not None:
        ready()
    groups = TensorGroups(record.rows)
    merged = groups.merge(record.partials)
    collector.disarm()
    return {
        "rows": [
            [r.name, int(c), record.partials[i].tolist()]
            for i, (r, c) in enumerate(zip(record.rows, record.collectives, strict=True))
        ],
        "kinds": sorted({str(r.kind) for r in record.rows}),
        "expected": ex.rows,
        "merged": {name: merged[i].tolist() for i, (_, _, name) in enumerate(groups.keys)},
        "expected_merged": {n: reference_partials(np.concatenate(a)).tolist() for n, a in ex.arrays.items()},
        "hook_calls": family_counts(main_hooks),
        "dispatch_calls": dict(dispatch.calls),
        "special_hook_calls": dict(comm._HUB.calls_by_op - main_hooks),
        "special_dispatch_calls": dict(special.calls),
        "objects": [o["rank"] for o in objects],
        "restored": dist.all_reduce is comm._originals()["all_reduce"] and not comm.installed_wrappers(),
    }


def run_megatron_aliases(rank: int, world: int) -> dict:
    """Megatron's distributed-optimizer buffers issue their reduce-scatter and all-gather through aliases
    bound at import (``dist_reduce_scatter_func``, ``dist_all_gather_func``, ``_coalescing_manager``), inside
    async coalescing blocks waited later (``cm.wait()``): called here exactly as ``param_and_grad_buffer``
    calls them."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    state, buffer = LoopPosition(), StepBuffer(1e-8)
    collector = comm.CommCollector(state, buffer, CcDistribution(enable=True, cc_pre_hook=True))
    buffer.count_collectives = collector.count
    collector.arm()
    comm._HUB.calls_by_op.clear()
    buffer._collectives_at_start = collector.count()
    patched = sorted(attr for holder, attr in comm.installed_wrappers() if holder is pgb)
    ex = Expect(collector)
    group = dist.new_group([0, 1])
    label = comm.group_label(group)
    dispatch = DispatchCount()
    with dispatch:
        grads = [values(rank, 4 * world, 50 + i) for i in range(2)]
        shards = [torch.zeros(4) for _ in grads]
        with pgb._coalescing_manager(group, async_ops=True) as cm:
            for shard, grad in zip(shards, grads, strict=True):
                ex.take(f"reduce_scatter_tensor.{label}.input", grad)
                pgb.dist_reduce_scatter_func(shard, grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
        cm.wait()
        for shard in shards:
            ex.take(f"reduce_scatter_tensor.{label}.output", shard)
        params = [torch.zeros(3 * world) for _ in range(2)]
        local = [values(rank, 3, 60 + i) for i in range(2)]
        with pgb._coalescing_manager(group, async_ops=False):
            for full, piece in zip(params, local, strict=True):
                ex.take(f"all_gather_into_tensor.{label}.input", piece)
                pgb.dist_all_gather_func(full, piece, group=group, async_op=False)
        for full in params:
            ex.take(f"all_gather_into_tensor.{label}.output", full)
    record, ready = buffer.finish(0, rank)
    collector.disarm()
    return {
        "patched": patched,
        "rows": [
            [r.name, int(c), record.partials[i].tolist()]
            for i, (r, c) in enumerate(zip(record.rows, record.collectives, strict=True))
        ],
        "expected": ex.rows,
        "hook_calls": family_counts(comm._HUB.calls_by_op),
        "dispatch_calls": dict(dispatch.calls),
        "restored": pgb.dist_all_gather_func is dist.all_gather_into_tensor and not comm.installed_wrappers(),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(sys.argv) > 2 and sys.argv[2] == "megatron":
        result = run_megatron_aliases(rank, world)
    else:
        result = run(rank, world)
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
