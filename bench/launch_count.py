"""Kernel launches the monitor adds per collected step with the Triton backend, counted on any machine.

The GPU benchmark's model (``../shared/bench/gpt_cuda.py``: 16 layers, d=1024, 16 heads, vocab 32768) runs
on the CPU with a tiny batch (the count of launches depends on the modules and parameters, not on the batch
or sequence length). The Triton kernels are replaced by counters that launch nothing, so every host-side
step of the Triton path runs (tensor tables, descriptors, shared rows) without a GPU; the statistics
themselves are not computed. Prints, per collected step: rows recorded, launches per kernel, and the ops
the torch-ops backend (devices without Triton) issues instead.

    python bench/launch_count.py                     # the GPU benchmark's model
    python bench/launch_count.py --layers 4 --steps 3
    python bench/launch_count.py --layers 1 --d 32 --heads 2 --vocab 64 --json counts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets the Triton path accept CPU tensors; nothing runs

REPO = Path(__file__).resolve().parents[1]
SHARED_WORKLOAD = REPO.parent / "shared" / "bench"
# ../shared/bench/gpt_cuda.py, else the repository's copy (bench/gpt_cuda.py: the same model)
DEFAULT_WORKLOAD = SHARED_WORKLOAD if (SHARED_WORKLOAD / "gpt_cuda.py").exists() else REPO / "bench"

FULL = {
    "xy_distribution": True,
    "all_xy": True,
    "wg_distribution": True,
    "mv_distribution": True,
    "param_distribution": True,
    "ur_distribution": True,
    "format": "csv",
}


class _Counters:
    """Stands in for trainmon.stats.triton_kernels: ``kernel[grid](...)`` counts and returns; constants
    (``PARTIAL_WIDTH``, ...) and the ``triton`` module are the real ones."""

    def __init__(self, real) -> None:
        self._real = real
        self.launches: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str):
        value = getattr(self._real, name)
        if name == "triton" or not hasattr(value, "__getitem__"):
            return value
        counter = self.launches

        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counter[name] += 1

                return launch

        return Launcher()


class _TorchOps:
    """Counts the ops the torch-ops backend issues (what a device without Triton runs)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[func.__name__.split(".")[0]] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--d", type=int, default=1024, help="width (launches do not depend on it)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--json", type=Path, help="also write the counts here")
    parser.add_argument("--steps", type=int, default=3, help="collected steps measured after one warm-up")
    parser.add_argument("--workload-dir", type=Path, default=DEFAULT_WORKLOAD)
    args = parser.parse_args()
    sys.path.insert(0, str(args.workload_dir))
    import torch
    import torch.nn.functional as F
    from gpt_cuda import GPT  # the GPU yardstick's model

    import trainmon
    from trainmon import stats
    from trainmon.stats import triton_path

    logging.getLogger("trainmon").setLevel(logging.CRITICAL)  # garbage rows: nothing is computed
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d, h=args.heads, layers=args.layers, T=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (1, 17))

    def step(monitor) -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        monitor.track("loss", loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    stats.set_backend("triton")
    counters = _Counters(triton_path.kernels())
    triton_path._kernels = counters
    with (
        tempfile.TemporaryDirectory(prefix="tm-launch-") as logdir,
        trainmon.attach(model, optimizer, config=FULL, logdir=logdir) as monitor,
    ):
        step(monitor)  # tables built, buffers grown
        counters.launches.clear()
        for _ in range(args.steps):
            step(monitor)
        rows = monitor._latest[0].rows

    per_step = {k: v / args.steps for k, v in sorted(counters.launches.items())}
    kinds = collections.Counter(r.kind for r in rows)
    params = sum(1 for _ in model.parameters())
    print(f"GPT: {args.layers} layers, {params} parameters; {len(rows)} rows per collected step")
    print("rows per kind:", dict(kinds))
    print("Triton launches per collected step:", per_step, "total", sum(per_step.values()))

    stats.set_backend("torch")
    ops = _TorchOps()
    with tempfile.TemporaryDirectory(prefix="tm-launch-") as logdir:
        with trainmon.attach(model, optimizer, config=FULL, logdir=logdir) as monitor:
            step(monitor)
            with ops.mode():
                step(monitor)
        with trainmon.attach(model, optimizer, config={**FULL, "module_ranks": [99]}, logdir=logdir) as idle:
            step(idle)
            baseline = _TorchOps()
            with baseline.mode():
                step(idle)
    views = {
        "view",
        "detach",
        "alias",
        "select",
        "slice",
        "as_strided",
        "t",
        "expand",
        "reshape",
        "_unsafe_view",
    }
    added = {op: n - baseline.counts[op] for op, n in ops.counts.items() if op not in views}
    torch_ops = sum(v for v in added.values() if v > 0)
    print("torch-ops backend, ops added per collected step:", torch_ops)
    if args.json:
        result = {
            "layers": args.layers,
            "parameters": params,
            "rows": len(rows),
            "triton_launches": per_step,
            "triton_launches_total": sum(per_step.values()),
            "torch_ops_added": torch_ops,
        }
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
