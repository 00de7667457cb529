"""Everything after the host copy: the background writer thread (``thread``) and its sinks: TensorBoard event
files (``tensorboard``), msprobe-compatible CSV (``csv``), the statistics store (``statstore``), the run
manifest (``manifest``) and tensor dumps (``dumps``); ``outputs`` picks the sinks a config asks for
(``sinkplan``: as data) and where they run: in the writer process (``process``, ``child``, ``wire``) or the
writer thread. See ``docs/output.md`` for the on-disk layout."""
