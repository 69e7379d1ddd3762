"""Model files, their configs and weight loading; a registry from the architecture string to the model class."""

from a4._overlay import overlay

overlay(__name__, __path__)
