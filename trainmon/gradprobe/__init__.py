"""Gradient fingerprints (``grad_probe``): their on-disk format, writing, reading, and run-vs-run comparison.

The collector that computes them during training is :mod:`trainmon.collect.gradprobe`; ``trainmon compare``
is the command line. See ``docs/grad_probe.md``.
"""
