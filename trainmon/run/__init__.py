"""The run directory: the one contract between the job that writes a run and everything that reads it.

Every path is spelled once (:mod:`~trainmon.run.layout`); the record schema and the rule names records carry
(:mod:`~trainmon.run.records`); the file formats, with their encoders and readers: the columnar tables
(:mod:`~trainmon.run.columnar`: Arrow IPC streams sealed into Parquet segments, partitioned by rank) of the
statistics store (:mod:`~trainmon.run.statstore`), the anomaly records (:mod:`~trainmon.run.anomaly_table`;
their JSON form and the old layout's files: :mod:`~trainmon.run.anomalies`) and the steps
(:mod:`~trainmon.run.steptable`), the rank summaries (:mod:`~trainmon.run.summary`), the manifest
(:mod:`~trainmon.run.manifest`), tensor dumps and requests (:mod:`~trainmon.run.dumps`), gradient
fingerprints (:mod:`~trainmon.run.gradprobe`), and how every append-only file is appended
(:mod:`~trainmon.run.append`). Like TensorBoard's ``metadata.py`` for a plugin, it imports no torch and
nothing else of trainmon, so readers (the CLI, the TensorBoard plugin) need neither.
"""
