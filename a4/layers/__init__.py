"""The building blocks of the models: norms, RoPE, MLPs, attention over the paged KV pool, Gated DeltaNet."""

from a4._overlay import overlay

overlay(__name__, __path__)
