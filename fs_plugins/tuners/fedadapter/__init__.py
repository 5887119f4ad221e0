"""FedAdapter's bottleneck adapters (Cai et al., MobiCom 2022) with a settable active depth and
width over fixed-shape parameters.

- `config`: `AdapterConfig` (targets, the fixed width);
- `layer`: `BottleneckAdapter` (down-projection, ReLU, up-projection, added to its module's output);
- `model`: `inject_adapters`, `set_active` (the top-`depth` layers, the first `width` units).
"""
from fs_plugins.tuners.fedadapter.config import AdapterConfig
from fs_plugins.tuners.fedadapter.layer import BottleneckAdapter
from fs_plugins.tuners.fedadapter.model import (
    ADAPTER_TAG,
    adapter_layers,
    inject_adapters,
    layer_of,
    set_active,
)

__all__ = ['ADAPTER_TAG', 'AdapterConfig', 'BottleneckAdapter', 'adapter_layers',
           'inject_adapters', 'layer_of', 'set_active']
