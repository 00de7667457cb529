"""What the ranks' agreements cost (trainmon.step.agree, trainmon.config.watch.ConfigReloads): 2 processes on
gloo, 127.0.0.1.

* an exchange step without an edit: the 24-byte broadcast every rank joins;
* a step between exchanges: rank 0's ``os.stat`` of the config file, nothing on the other ranks;
* the ``on_nan: skip`` agreement: one all-reduce MAX of one number;
* the exchange that carries an edit (three collectives and a config load on every rank).

    python bench/agreement.py --calls 2000
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def worker(rank: int, port: int, calls: int, folder: str, out: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    from trainmon.config import load_config
    from trainmon.config.watch import ConfigReloads
    from trainmon.step.agree import RankAgreement

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    path = Path(folder) / "monitor.json"
    agreement = RankAgreement(60.0)
    reloads = ConfigReloads(path, load_config(path), agreement, settle_s=0.0)
    reloads.at_attach()
    step = [0]

    def exchange() -> None:  # every step an exchange step
        reloads._next = None
        reloads.at_step_end(step[0])
        step[0] += 1

    def between() -> None:  # a step before the next exchange
        reloads._next = step[0] + 10**9
        reloads.at_step_end(step[0])
        step[0] += 1

    def skip() -> None:
        agreement.max(0, "bench")

    results = {"exchange_us": [], "between_us": [], "skip_agreement_us": []}
    for _ in range(3):
        results["exchange_us"].append(_per_call_us(exchange, calls))
        results["between_us"].append(_per_call_us(between, calls))
        results["skip_agreement_us"].append(_per_call_us(skip, calls))
    # an exchange carrying an edit: rank 0 alternates two configs
    edits = []
    for i in range(20):
        if rank == 0:
            path.write_text(json.dumps({"wg_distribution": True, "step_interval": 2 + i % 2}))
        dist.barrier()
        start = time.perf_counter()
        reloads._next = None
        change = reloads.at_step_end(step[0])
        edits.append((time.perf_counter() - start) * 1e6)
        step[0] += 1
        assert change is not None, i
    results["edit_exchange_us"] = [statistics.median(edits)]
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in results.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="tm-agree-") as folder:
        (Path(folder) / "monitor.json").write_text(json.dumps({"wg_distribution": True}))
        out = str(Path(folder) / "result.json")
        mp.spawn(worker, args=(port, args.calls, folder, out), nprocs=2, join=True)
        result = json.loads(Path(out).read_text())
    for key, value in result.items():
        print(f"{key:<20}{value:>10.1f} us")


if __name__ == "__main__":
    main()
