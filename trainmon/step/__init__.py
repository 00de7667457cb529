"""The life of one step on the training thread: where the loop is (:mod:`~trainmon.step.position`), whether
the step is collected (:mod:`~trainmon.step.schedule`), the device buffer the hooks append statistics to and
its one host copy (:mod:`~trainmon.step.buffer`), the NaN check before the update
(:mod:`~trainmon.step.boundary`), tensors taken for dumps (:mod:`~trainmon.step.capture`) and the in-memory
view of a finished step (:mod:`~trainmon.step.stepstats`)."""
