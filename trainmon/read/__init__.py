"""Everything that reads a finished or running run, through :mod:`trainmon.run`: the ranks' summaries
(:mod:`~trainmon.read.summaries`), the scan behind ``trainmon analyze`` (:mod:`~trainmon.read.scan`),
``--explain`` (:mod:`~trainmon.read.explain`), what a dump holds (:mod:`~trainmon.read.dump_contents`), where
a run stands (:mod:`~trainmon.read.runstate`) and the CSV files of trainmon and msprobe runs
(:mod:`~trainmon.read.csv_sources`, :mod:`~trainmon.read.csv`)."""
