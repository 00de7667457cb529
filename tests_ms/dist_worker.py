"""One rank of a 2-process data-parallel MindSpore job (started by msrun in test_distributed.py): each rank
trains on its own batches, gradients are averaged by DistributedGradReducer, and rank 1 poisons a Cell's
output at step NAN_STEP. Writes the monitor's rank and world size to RUN/identity_rank<r>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn
from mindspore.communication import get_rank, init

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CONFIG, NAN_STEP, Net  # noqa: E402

import trainmon.mindspore  # noqa: E402


def main() -> None:
    run = Path(sys.argv[1])
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init()
    rank = get_rank()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ms.set_seed(0)  # the same initial weights on every rank
    net = Net()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    reducer = nn.DistributedGradReducer(opt.parameters, mean=True)
    config = dict(CONFIG, alert={"rules": [{"rule": "nan"}]})
    mon = trainmon.mindspore.attach(net, opt, config=config, logdir=run)
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, opt.parameters)
    rng = np.random.default_rng(100 + rank)  # each rank its own data
    for step in range(4):
        net.bad.poisoned = rank == 1 and step == NAN_STEP
        _, grads = grad_fn(ms.Tensor(rng.standard_normal((3, 4)).astype(np.float32)))
        opt(reducer(grads))
    mon.close()
    (run / f"identity_rank{rank}.json").write_text(json.dumps({"rank": mon.rank, "world": mon.world_size}))


if __name__ == "__main__":
    main()
