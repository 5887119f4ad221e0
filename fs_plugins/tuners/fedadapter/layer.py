"""One bottleneck adapter (Houlsby et al., ICML 2019, as FedAdapter uses it):
y + up(relu(down(y))) on a module's output y, in float32 over a possibly low-precision base.

Its parameters have the fixed width `max_width`; `width` (a Python int, read on every forward
without a device synchronisation) selects the first units in use. The unused units are sliced
off, so they get no gradient and cost no compute; width 0 switches the adapter off."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BottleneckAdapter(nn.Module):
    def __init__(self, features: int, max_width: int, init_std: float, device=None):
        super().__init__()
        self.max_width = max_width
        self.down = nn.Linear(features, max_width, dtype=torch.float32, device=device)
        self.up = nn.Linear(max_width, features, dtype=torch.float32, device=device)
        with torch.no_grad():
            nn.init.normal_(self.down.weight, std=init_std)
            self.down.bias.zero_()
            self.up.weight.zero_()
            self.up.bias.zero_()
        self.width = 0

    def set_width(self, width: int) -> None:
        if not 0 <= width <= self.max_width:
            raise ValueError(f'adapter width {width} outside [0, {self.max_width}]')
        self.width = int(width)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        """The module's output with the adapter's residual added (unchanged at width 0)."""
        w = self.width
        if w == 0:
            return output
        hidden = F.relu(F.linear(output.to(torch.float32), self.down.weight[:w], self.down.bias[:w]))
        return output + F.linear(hidden, self.up.weight[:, :w], self.up.bias).to(output.dtype)
