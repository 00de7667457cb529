"""The first anomaly of a real 2-process DDP run (gloo, 127.0.0.1): only rank 1 makes a NaN, in the forward of
one module; after DDP's gradient all-reduce rank 0 sees NaN too, yet ``trainmon analyze`` names rank 1, that
step, that module and the forward phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from launch import free_port

from trainmon.cli import main
from trainmon.run.anomaly_table import read_anomalies
from trainmon.run.layout import anomalies_rank_dir

POISON_STEP = 2
POISON_MODULE = "module.layers.1.mlp.fc2"  # the DDP wrapper's child is named "module"

WORKER = textwrap.dedent(
    """
    import datetime
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel

    import trainmon
    from trainmon.demo import DemoSetup, build, lm_loss, synthetic_batch

    STEPS = 4


    def worker(rank, port, run_dir, poison_step):
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=60),
        )
        setup = DemoSetup(batch=4, layers=2, dim=32)
        model, _ = build(setup, seed=0)  # the same initial weights on both ranks
        poison = {"on": False}

        def nan_forward(module, args, output):
            return output * float("nan") if poison["on"] else output

        # registered before trainmon's hooks (forward hooks run in registration order), so trainmon
        # records the poisoned output; registered after attach, the origin would be layers.1.mlp instead
        handle = model.layers[1].mlp.fc2.register_forward_hook(nan_forward)
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=setup.lr)
        config = {"xy_distribution": True, "all_xy": True, "wg_distribution": True}
        mon = trainmon.attach(ddp, optimizer, config=config, logdir=run_dir)
        generator = torch.Generator().manual_seed(100 + rank)  # different data on each rank
        for step in range(STEPS):
            poison["on"] = rank == 1 and step == poison_step
            loss = lm_loss(ddp, synthetic_batch(setup, generator))
            mon.track("loss", loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        handle.remove()
        mon.close()
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        port, run_dir, poison_step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        mp.spawn(worker, args=(port, run_dir, poison_step), nprocs=2, join=True)
    """
)



@pytest.mark.slow
@pytest.mark.timeout(120)
def test_first_anomaly_names_the_rank_step_and_module_that_made_the_nan(tmp_path, capsys):
    run = tmp_path / "run"
    script = tmp_path / "ddp_worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(run), str(POISON_STEP)],
        env=env, capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert anomalies_rank_dir(run, 0).is_dir() and anomalies_rank_dir(run, 1).is_dir()
    assert (run / "rank_0").is_dir() and (run / "rank_1").is_dir()

    rank0 = [a for a in read_anomalies(run, 0) if a.step == POISON_STEP]
    rank1 = [a for a in read_anomalies(run, 1) if a.step == POISON_STEP]
    # rank 0 made no NaN in its forward or backward, but the all-reduced gradients it steps with are NaN
    assert rank0 and all(a.rank == 0 for a in rank0)
    assert any(a.rule == "nan" and a.kind == "grad_reduced" and a.phase == "optimizer" for a in rank0)
    assert not [a for a in rank0 if a.phase in ("forward", "backward")], rank0
    assert not any(a.origin for a in rank0)
    # each record counts the collectives its rank had issued in the step: rank 0's NaN arrived through DDP's
    # gradient all-reduce (at least one collective into the step); rank 1's origin came before any
    assert all(a.collectives >= 1 for a in rank0 if a.step == POISON_STEP)
    # rank 1 found the origin in its forward
    assert any(a.origin and a.name == f"{POISON_MODULE}.output" and a.phase == "forward" for a in rank1)
    assert all(a.collectives == 0 for a in rank1 if a.step == POISON_STEP and a.phase == "forward")
    # no rank saw anything before the poisoned step
    for r in (0, 1):
        assert min(a.step for a in read_anomalies(run, r)) == POISON_STEP

    assert main(["analyze", str(run), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)["first"]
    got = (first["rank"], first["step"], first["phase"], first["kind"], first["name"], first["origin"])
    assert got == (1, POISON_STEP, "forward", "actv", f"{POISON_MODULE}.output", True)
