"""Where request memory lives: the paged KV pool, the per-slot state pool and the radix prefix cache."""

from a4._overlay import overlay

overlay(__name__, __path__)
