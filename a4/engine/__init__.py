"""The engine: the memory plan, the model runner and the step loop that ties scheduler and model together."""

from a4._overlay import overlay

overlay(__name__, __path__)
