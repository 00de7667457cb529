"""Everything after the host copy: the background writer thread and its sinks (TensorBoard event
files, msprobe-compatible CSV, the run manifest). See ``docs/output.md`` for the on-disk layout."""

from trainmon.writer.csv import CsvSink
from trainmon.writer.manifest import Manifest, ManifestSink, read_manifest, write_manifest
from trainmon.writer.statstore import StatStoreSink
from trainmon.writer.tensorboard import EventFile, TensorBoardSink
from trainmon.writer.thread import Sink, WriterThread

__all__ = [
    "CsvSink",
    "EventFile",
    "Manifest",
    "ManifestSink",
    "Sink",
    "StatStoreSink",
    "TensorBoardSink",
    "WriterThread",
    "read_manifest",
    "write_manifest",
]
