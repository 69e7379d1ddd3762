"""Speculative decoding (notebook 11): drafts proposed cheaply, verified in one forward of the main model, and the
Gated DeltaNet states committed at the accepted length (a state cannot be rewound like a KV cache)."""

from a4._overlay import overlay

overlay(__name__, __path__)
