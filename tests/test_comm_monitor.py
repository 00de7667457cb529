"""``cc_distribution`` through ``trainmon.attach`` in a real 2-process run: the job's own all_reduce of the
loss is recorded (input and output statistics equal the tensors'), nothing else is, and training is
bitwise unchanged."""

from __future__ import annotations

import json
import textwrap

import pytest
from launch import run_worker_script

WORKER = textwrap.dedent(
    """
    import datetime
    import json
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    import trainmon
    from trainmon import stats
    from trainmon.run import records

    STEPS = 3


    def run(rank, out, monitored):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = {"cc_distribution": {"enable": True, "cc_pre_hook": True}, "wg_distribution": True}
        mon = trainmon.attach(model, optimizer, config=config, logdir=f"{out}/run") if monitored else None
        gen = torch.Generator().manual_seed(5 + rank)
        losses, seen = [], []
        for step in range(STEPS):
            loss = model(torch.randn(4, 6, generator=gen)).pow(2).mean()
            loss.backward()
            mean_loss = loss.detach().clone()
            before = mean_loss.clone()
            dist.all_reduce(mean_loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(mean_loss.item())
            if mon is not None:
                got = mon.latest()
                want_in = records.derive(stats.partials(before).double().numpy())
                want_out = records.derive(stats.partials(mean_loss).double().numpy())
                seen.append({
                    "keys": sorted(k for k in got if k.startswith("comm/")),
                    "in_max": [got["comm/all_reduce.world.input"]["max"], float(want_in["max"][0])],
                    "out_max": [got["comm/all_reduce.world.output"]["max"], float(want_out["max"][0])],
                })
        if mon is not None:
            mon.close()
        return losses, seen


    def worker(rank, port, out):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        plain, _ = run(rank, out, False)
        monitored, seen = run(rank, out, True)
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"plain": plain, "monitored": monitored, "seen": seen}, f)
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_attach_with_cc_distribution_records_the_jobs_collectives(tmp_path):
    run_worker_script(WORKER, tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["plain"] == got["monitored"]  # bitwise: the same floats
        for step in got["seen"]:
            # the job's one all_reduce (of the loss) is recorded; nothing of the monitor's own
            assert step["keys"] == ["comm/all_reduce.world.input", "comm/all_reduce.world.output"]
            assert step["in_max"][0] == step["in_max"][1]
            assert step["out_max"][0] == step["out_max"][1]
