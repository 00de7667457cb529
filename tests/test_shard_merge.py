"""Exact statistics of tensors split over ranks: a real 2-process gloo run whose optimizer adapter gives each
rank one uneven piece of every gradient, Adam moment and parameter (odd sizes; a 1-element bias whose second
piece is empty). The merged statistics equal the statistics of the whole tensors, and a collected step costs
exactly two extra collectives (the step times' exchange, a third where no all_ranks merge carries it, is off
here: tests/test_timing.py counts it)."""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import assert_stats_close
from launch import run_worker_script

WORKER = textwrap.dedent(
    """
    import datetime
    import json
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel

    from trainmon import stats

    from trainmon.run import records
    from trainmon.adapters import Resolved, Shard
    from trainmon.adapters.torch_optim import TorchOptimizerAdapter
    from trainmon.config import load_config
    from trainmon.monitor import Monitor

    STEPS = 4


    # ranks that hold no gradient of this parameter (an expert no token reached, a frozen branch): the
    # merge must line up anyway (sys.argv[3] == "missing")
    MISSING = {"module.0.bias": 1, "module.2.weight": 0}
    MISSING_MOMENTS = {"module.2.bias": 1}  # ... and of Adam's moments (so of update and ratio too)


    class SplitAdapter(TorchOptimizerAdapter):
        # rank 0 holds the first 60% of every flattened tensor, rank 1 the rest (empty for 1 element)
        sharded = True

        def __init__(self, optimizer, rank, names, missing):
            super().__init__(optimizer)
            self.rank = rank
            self.missing = {id(p) for n, p in names.items() if missing and MISSING.get(n) == rank}
            self.no_moments = {id(p) for n, p in names.items() if missing and MISSING_MOMENTS.get(n) == rank}

        def grad(self, param):
            return None if id(param) in self.missing else self._piece(param.grad)

        def _piece(self, t):
            if t is None:
                return None
            flat = t.detach().reshape(-1)
            cut = (flat.numel() * 3 + 4) // 5
            return Shard(flat[:cut] if self.rank == 0 else flat[cut:], None, tuple(t.shape))

        def value(self, param):
            return self._piece(param)

        def moments(self, param):
            m = None if id(param) in self.no_moments else super().moments(param)
            return None if m is None else (self._piece(m[0]), self._piece(m[1]))


    def whole(t):
        return records.derive(stats.partials(t.detach()).double().numpy())


    def worker(rank, port, out, missing):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=0.05)
        grads = {}
        optimizer.register_step_pre_hook(
            lambda opt, a, k: grads.update({n: p.grad.clone() for n, p in ddp.named_parameters()}))
        config = load_config({"wg_distribution": True, "mv_distribution": True, "param_distribution": True,
                              "ur_distribution": True, "step_interval": 2, "format": ["api"],
                              "timing": {"enable": False}})
        adapter = SplitAdapter(optimizer, rank, dict(ddp.named_parameters()), missing)
        mon = Monitor(Resolved((ddp,), adapter), config, out + f"/run")
        group = dist.distributed_c10d._get_default_group()
        checks, deltas = [], []
        gen = torch.Generator().manual_seed(10 + rank)
        for step in range(STEPS):
            x = torch.randn(8, 7, generator=gen)
            before = group._get_sequence_number_for_group()
            ddp(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            deltas.append(group._get_sequence_number_for_group() - before)
            if step % 2:
                continue
            latest = mon.latest()
            for name, p in ddp.named_parameters():
                state = optimizer.state[p]
                for kind, t in (("grad_reduced", grads[name]), ("param_updated", p),
                                ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
                    lacking = MISSING if kind == "grad_reduced" else MISSING_MOMENTS
                    if kind != "param_updated" and missing and name in lacking:
                        # rank r lacks it: the merge holds the other rank's piece alone, and r has no row
                        holder = 1 - lacking[name]
                        flat = t.detach().reshape(-1)
                        cut = (flat.numel() * 3 + 4) // 5
                        t = flat[:cut] if holder == 0 else flat[cut:]
                        if rank != holder:
                            checks.append([kind, name, f"{kind}/{name}" in latest])
                            continue
                    ref = whole(t)
                    got = latest[f"{kind}/{name}"]
                    checks.append([kind, name, {s: [got[s], float(ref[s][0])] for s in records.STATS}])
        mon.close()
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"checks": checks, "deltas": deltas}, f)
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["missing"]), nprocs=2)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_shards_merge_into_the_statistics_of_the_whole_tensor(tmp_path):
    run_worker_script(WORKER, tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(got["checks"]) == 2 * 4 * 4  # 2 collected steps x 4 params x 4 kinds
        for kind, name, values in got["checks"]:
            # the kernel adds float32 tensors in float32 blocks, so another split of the elements rounds
            # the sums differently
            merged = {stat: pair[0] for stat, pair in values.items()}
            whole = {stat: pair[1] for stat, pair in values.items()}
            assert_stats_close(merged, whole, where=f"{kind} {name}")
        # from its third step on DDP issues the same collectives every step (the second one rebuilds its
        # buckets); a collected step adds exactly one SUM and one MAX all_reduce
        deltas = got["deltas"]
        assert deltas[2] - deltas[3] == 2, deltas


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ranks_that_lack_a_gradient_still_merge_in_step(tmp_path):
    """Which gradients exist never changes trainmon's collectives: a parameter without a gradient on one rank
    keeps its place in the merge, the other rank's row is its own piece alone, and the lacking rank writes
    no row of it (before, the ranks' merges had different sizes: a collective mismatch killed the job)."""
    run_worker_script(WORKER, tmp_path, "missing")
    lacking = {("grad_reduced", "module.0.bias"): 1, ("grad_reduced", "module.2.weight"): 0}
    lacking |= {(kind, "module.2.bias"): 1 for kind in ("exp_avg", "exp_avg_sq")}
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(got["checks"]) == 2 * 4 * 4
        seen = set()
        for kind, name, values in got["checks"]:
            if lacking.get((kind, name)) == rank:
                assert values is False, f"rank {rank} wrote a {kind} row of {name}, which it lacks"
                seen.add((kind, name))
                continue
            merged = {stat: pair[0] for stat, pair in values.items()}
            whole = {stat: pair[1] for stat, pair in values.items()}
            assert_stats_close(merged, whole, where=f"rank {rank} {kind} {name}")
        assert seen == {key for key, r in lacking.items() if r == rank}
        assert got["deltas"][2] - got["deltas"][3] == 2, got["deltas"]
