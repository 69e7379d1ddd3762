"""A Gated DeltaNet layer's states for the benches that run one layer by hand, as it finds them in a state pool."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LayerStates(NamedTuple):
    """One GDN layer's states for one request, as the layer finds them in a state pool (a4.core.GDNStates)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def conv_state(self, gdn_layer: int) -> torch.Tensor:
        return self.conv

    def recurrent_state(self, gdn_layer: int) -> torch.Tensor:
        return self.recurrent
