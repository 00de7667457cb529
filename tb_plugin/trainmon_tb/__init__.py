"""The TensorBoard plugin ``trainmon``: anomaly timeline, heatmaps and tensor dumps of trainmon runs.

TensorBoard loads :class:`trainmon_tb.loader.TrainmonLoader` (entry point group ``tensorboard_plugins``);
nothing heavy is imported here so that a broken install can never stop TensorBoard from starting.
"""
