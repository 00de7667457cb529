"""Training loops that own the step: one callback each, in the loop's own convention.

``trainmon.loops.huggingface.TrainmonCallback`` for Hugging Face's ``Trainer``,
``trainmon.loops.lightning.TrainmonCallback`` for Lightning. Each takes from the loop what ``attach`` would
otherwise be told: the module that runs, the torch optimizer inside the loop's wrapper, the micro-batches of
a step, the step numbers and the loss. Importing this package imports no loop library.
"""
