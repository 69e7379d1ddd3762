"""Request slots (TableManager), continuous batching, chunked prefill and admission control."""

from a4._overlay import overlay

overlay(__name__, __path__)
