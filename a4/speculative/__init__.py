"""Speculative decoding: drafters propose tokens, one forward of the main model verifies them, states are committed."""

from a4._overlay import overlay

overlay(__name__, __path__)
