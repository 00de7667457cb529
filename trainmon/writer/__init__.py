"""Everything after the host copy: the background writer thread (``thread``) and its sinks: TensorBoard event
files (``tensorboard``), msprobe-compatible CSV (``csv``), the statistics store (``statstore``), the run
manifest (``manifest``) and tensor dumps (``dumps``); ``outputs`` picks the sinks a config asks for. See
``docs/output.md`` for the on-disk layout."""
