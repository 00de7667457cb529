"""CSV at scale (``csv_ranks``): every rank's statistics are in the statistics store, so above 16 ranks the
CSV files (~30 KB a rank and step for ~300 tensors) are written by the ranks that write TensorBoard events,
unless the store is not written (``format: csv`` alone) or the config asks for them."""

from __future__ import annotations

import pytest

from trainmon.config import ConfigError, load_config
from trainmon.writer.outputs import csv_ranks, format_sinks


@pytest.mark.parametrize(
    ("config", "world", "ranks"),
    [
        ({}, 16, set(range(16))),
        ({}, 1024, {0, 1023}),
        ({"tensorboard_ranks": [0, 5, -2]}, 64, {0, 5, 62}),  # auto follows the ranks with events
        ({"format": ["csv"]}, 1024, set(range(1024))),  # no statistics store: the CSV is the only record
        ({"csv_ranks": "all"}, 1024, set(range(1024))),
        ({"csv_ranks": [3, -1, 4096]}, 1024, {3, 1023}),
        ({"csv_ranks": []}, 4, set()),
    ],
)
def test_csv_ranks(config, world, ranks):
    assert csv_ranks(load_config(config), world) == ranks


def test_a_rank_left_out_writes_the_store_and_no_csv(tmp_path):
    names = lambda sinks: [type(s).__name__ for s in sinks]  # noqa: E731
    both = {"format": ["tensorboard", "csv"]}  # CSV is asked for since issue 33
    config = load_config(both)
    left_out = format_sinks(config, tmp_path, 5, False, world=64, aggregates=True)
    kept = format_sinks(config, tmp_path, 63, False, world=64, aggregates=True)
    everyone = format_sinks(load_config({"csv_ranks": "all", **both}), tmp_path, 6, False, world=64,
                            aggregates=True)  # fmt: skip
    try:
        assert names(left_out) == ["StatStoreSink"]
        assert names(kept) == ["TensorBoardSink", "StatStoreSink", "CsvSink"]
        assert names(everyone) == ["StatStoreSink", "CsvSink"]
    finally:
        for s in left_out + kept + everyone:
            s.close()


@pytest.mark.parametrize("bad", ["some", True, [0.5]])
def test_csv_ranks_is_validated(bad):
    with pytest.raises(ConfigError, match="csv_ranks"):
        load_config({"csv_ranks": bad})
    assert load_config({"csv_ranks": "0,-1"}).csv_ranks == (0, -1)
