"""A finished step's statistics as a mapping, the value of ``Monitor.latest()`` in every framework."""

from __future__ import annotations

from collections.abc import Mapping

from trainmon.run import records
from trainmon.run.records import StepRecord


class StepStats(Mapping[str, Mapping[str, float]]):
    """Statistics of one finished step, keyed by ``"{kind}/{name}"`` then stat (msprobe's "api" format).

    Names are TensorBoard's (chunk prefix with several model chunks); micro-batches of one tensor are
    merged into the step-level value, as in TensorBoard.
    """

    def __init__(self, record: StepRecord, multi_chunk: bool) -> None:
        self.step = record.step
        self.rank = record.rank
        groups = records.TensorGroups(record.rows)
        derived = records.derive(groups.merge(record.partials))
        self._values = {
            f"{kind}/{records.chunk_name(vpp, name, multi_chunk)}": {
                s: float(derived[s][i]) for s in records.STATS
            }
            for i, (kind, vpp, name) in enumerate(groups.keys)
        }

    def __getitem__(self, key: str) -> Mapping[str, float]:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"StepStats(step={self.step}, rank={self.rank}, {len(self)} tensors)"
