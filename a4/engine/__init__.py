"""The engine: the memory plan, the model runner and the step loop that ties scheduler and model together, with its
speculative (speculative_worker.py) and tensor-parallel (tp_driver.py, tp_worker.py) variants."""

from a4._overlay import overlay

overlay(__name__, __path__)
