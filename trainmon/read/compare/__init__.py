"""Two runs compared from their statistics (``trainmon compare``, the trainmon tab's comparison view): the
first tensor whose statistics differ beyond tolerance, in the order things happened in a step, and what that
says. docs/compare.md is the user's guide; the modules, in the order a comparison uses them:

- :mod:`~trainmon.read.compare.source`: a run's ranks and steps, its statistics a step range at a time
  (rank by rank, or as whole tensors for runs of different parallel layouts);
- :mod:`~trainmon.read.compare.tensors`: a row's phase and module;
- :mod:`~trainmon.read.compare.names`, :mod:`~trainmon.read.compare.mapfile`,
  :mod:`~trainmon.read.compare.align`: which tensor of one run is which of the other;
- :mod:`~trainmon.read.compare.tolerance`, :mod:`~trainmon.read.compare.plan`: each pair's tolerance;
- :mod:`~trainmon.read.compare.diff`, :mod:`~trainmon.read.compare.state`: relative differences, scores, and
  the slack of the state a step started from;
- :mod:`~trainmon.read.compare.engine`: the step ranges walked, the first divergence found;
- :mod:`~trainmon.read.compare.verdict`: what it means, with its evidence;
- :mod:`~trainmon.read.compare.report`, :mod:`~trainmon.read.compare.output`,
  :mod:`~trainmon.read.compare.heatmap`, :mod:`~trainmon.read.compare.dumps`: the terminal report and its
  JSON, the report folder, the plugin's heatmap, the dump requests of the divergence.
"""
