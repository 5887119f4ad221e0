"""FLAME's adapter pieces on a sparse MoE model (LoRA on the experts themselves is peft's,
through `target_parameters`):

- `routing`: setting each router's top-k, and counting per expert how
  often it was selected in local training (`RoutingTracker`: routed token slots and activated
  steps);
- `rescaler`: the client-local scale s_i on each MoE block's output (learnable, static k/k_i,
  or none).
"""
from fs_plugins.models.olmoe import moe_blocks
from fs_plugins.tuners.flame.rescaler import RESCALE_MODES, RESCALE_NAME, install_rescaler, set_static_scale
from fs_plugins.tuners.flame.routing import ACTIVATION_READINGS, RoundActivation, RoutingTracker

__all__ = ['RESCALE_NAME', 'RESCALE_MODES', 'install_rescaler', 'set_static_scale',
           'ACTIVATION_READINGS', 'RoundActivation', 'RoutingTracker', 'moe_blocks']
