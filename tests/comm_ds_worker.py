"""DeepSpeed ZeRO worker for tests/test_comm.py (2 processes, gloo, DS_ACCELERATOR=cpu).

``python comm_ds_worker.py OUT_DIR STAGE`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. Trains the same
small model twice from the same seed: without trainmon, then with the collective collector armed for every
step (ended at each optimizer step like the monitor does) and a ``TorchDispatchMode`` counting the ``c10d``
ops of the same region. Writes ``OUT_DIR/rank_<r>.json`` with both loss lists, the per-family call counts of
the wrappers and of the dispatcher, and the recorded row names and statistics per step.
"""

from __future__ import annotations

import datetime
import importlib
import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from comm_worker import DispatchCount, family_counts  # noqa: E402

from trainmon.collect import comm  # noqa: E402
from trainmon.config import CcDistribution  # noqa: E402
from trainmon.run.records import TensorGroups, derive  # noqa: E402
from trainmon.step.buffer import StepBuffer  # noqa: E402
from trainmon.step.position import LoopPosition  # noqa: E402

warnings.filterwarnings("ignore")
STEPS = 2


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def train(stage: int, rank: int, collector: comm.CommCollector | None, buffer: StepBuffer | None):
    import deepspeed

    torch.manual_seed(0)
    model = Odd()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    losses, steps = [], []
    dispatch = DispatchCount()
    if collector is not None:
        collector.arm()  # after initialize, as attach(engine) would: DeepSpeed's backend object exists now
        comm._HUB.calls_by_op.clear()
    with dispatch:
        for step in range(STEPS):
            x, y = torch.randn(4, 7, generator=generator), torch.randn(4, 5, generator=generator)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if collector is not None and buffer is not None:
                collector.step_end()
                record, _ = buffer.finish(step, rank)
                groups = TensorGroups(record.rows)
                derived = derive(groups.merge(record.partials))
                steps.append({name: derived["norm"][i] for i, (_, _, name) in enumerate(groups.keys)})
                collector.arm()
    hooks = Counter(comm._HUB.calls_by_op)
    if collector is not None:
        collector.disarm()
    return losses, family_counts(hooks), dict(dispatch.calls), steps


def main() -> None:
    out_dir, stage = Path(sys.argv[1]), int(sys.argv[2])
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no 70 s JIT build
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    plain, _, _, _ = train(stage, rank, None, None)
    state, buffer = LoopPosition(), StepBuffer(1e-8)
    collector = comm.CommCollector(state, buffer, CcDistribution(enable=True, cc_pre_hook=True))
    buffer.count_collectives = collector.count
    monitored, hooks, dispatch, steps = train(stage, rank, collector, buffer)
    result = {"plain": plain, "monitored": monitored, "hooks": hooks, "dispatch": dispatch, "steps": steps}
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
