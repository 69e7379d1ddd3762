"""Speculative decoding (notebook 11): drafts proposed cheaply, verified in one forward of the main model, and the
Gated DeltaNet states committed at the accepted length (a state cannot be rewound like a KV cache).

Here are the drafters (drafter.py) and notebook 11's verify functions (verify.py); the engine's step that drafts,
verifies and commits is a4/engine/speculative_worker.py, and the engine's factories hand the verify functions to the
GDN backends and the state pool, which sit below this package."""

from a4._overlay import overlay

overlay(__name__, __path__)
