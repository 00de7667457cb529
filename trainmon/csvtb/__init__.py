"""CSV <-> TensorBoard conversion for trainmon runs and msprobe monitor output (``trainmon csv2tb``,
``trainmon tb2csv``).

- :mod:`~trainmon.read.csv_sources` finds the CSV files of each rank and kind in trainmon and msprobe layouts;
- :mod:`~trainmon.read.csv` parses them (pandas' C parser, exact file/line/reason for bad rows);
- :mod:`~trainmon.csvtb.convert` streams a rank's tables into one TensorBoard run (trainmon's ``EventFile``),
  a batch of each kind at a time, in parallel processes over ranks;
- :mod:`~trainmon.csvtb.tb2csv` reads event files back into msprobe-style CSV.

See ``docs/csv2tb.md`` for the tag rule and the formats.
"""

from trainmon.csvtb.convert import ConvertError, ConvertSummary, convert, rank_tags
from trainmon.csvtb.tb2csv import tb2csv
from trainmon.read.csv import CsvError, KindTable, read_kind

__all__ = [
    "ConvertError",
    "ConvertSummary",
    "CsvError",
    "KindTable",
    "convert",
    "rank_tags",
    "read_kind",
    "tb2csv",
]
