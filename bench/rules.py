"""Rules engine cost per step: RuleEngine.evaluate on realistic step records.

Default: 1000 rows x 7 statistics x 3 rules (nan, turbulence, zscore, each on every statistic), a fresh
(equal) row tuple every step as the collector builds it, 500 steps. ``derive`` is not timed (the writer
computes it once for every sink). ``--micro 2`` gives every tensor two micro-step rows (merge path).

    python bench/rules.py [--rows 1000] [--steps 500] [--micro 1]

Target: well under 1 ms per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainmon.anomaly.rules import RuleEngine  # noqa: E402
from trainmon.config.rules import NanRule, TurbulenceRule, ZScoreRule  # noqa: E402
from trainmon.run import records  # noqa: E402


def make_rows(n: int, micro: int) -> tuple[records.Row, ...]:
    kinds = ("actv", "actv_grad", "grad_reduced", "exp_avg")
    rows = []
    for m in range(micro):
        for i in range(n // micro):
            kind = kinds[i % len(kinds)]
            rows.append(
                records.Row(kind, f"layers.{i // 4}.mlp.fc{i % 4}", 0, m, "forward", (1024, 1024), "bf16")
            )
    return tuple(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--micro", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    engine = RuleEngine(
        [
            NanRule(),
            TurbulenceRule(threshold=0.5, stats=records.STATS),
            ZScoreRule(threshold=6.0, warmup=20, stats=records.STATS),
        ]
    )
    n = len(make_rows(a.rows, a.micro))
    total, first, fired = 0.0, 0.0, 0
    for step in range(a.steps):
        rows = make_rows(a.rows, a.micro)  # a fresh, equal tuple each step
        p = np.zeros((n, records.N_PARTIALS))
        p[:, records.NUMEL] = 1 << 20
        p[:, records.ZEROS] = 1000 * (1 + 0.01 * rng.random(n))
        p[:, records.MIN] = -1 - 0.01 * rng.random(n)
        p[:, records.MAX] = 1 + 0.01 * rng.random(n)
        p[:, records.SUM] = 1000 * (1 + 0.01 * rng.random(n))
        p[:, records.SUMSQ] = 1e6 * (1 + 0.01 * rng.random(n))
        if step % 50 == 49:
            p[3, records.NANS] = 5
        rec = records.StepRecord(step, 0, rows, p, 0.0)
        derived = records.derive(p)
        t0 = time.perf_counter()
        fired += len(engine.evaluate(rec, derived))
        if step:
            total += time.perf_counter() - t0
        else:
            first = time.perf_counter() - t0  # builds the layout cache
    print(
        f"rules: {n} rows x {len(records.STATS)} stats x {len(engine.rules)} rules, micro={a.micro}: "
        f"{total / (a.steps - 1) * 1e3:.3f} ms/step over {a.steps - 1} steps ({fired} anomalies); "
        f"first step (layout cache) {first * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
