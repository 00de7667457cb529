"""Online precheck (issue 52): each API of a training step judged against a high-precision benchmark.

This folder grows with the issue. What is here: the standards, as one table of thresholds
(:mod:`trainmon.precheck.standards`), and the metrics and verdicts that compare an output the training
computed with its benchmark (:mod:`trainmon.precheck.judge`). Capture, transport and reports come next.
"""
