"""FedLEASE's per-layer adaptive top-M mixture of LoRA experts.

- `layer`: `LeaseMixture` (router + frozen other experts) and `expert_weights` (the 2M − 1 slot
  routing);
- `model`: `inject_lease`, which attaches mixtures to LoRA-wrapped modules, and `lease_layers`.
"""
from fs_plugins.tuners.lease.layer import LeaseMixture, expert_weights
from fs_plugins.tuners.lease.model import inject_lease, is_lease_router, lease_layers

__all__ = ['LeaseMixture', 'expert_weights', 'inject_lease', 'is_lease_router', 'lease_layers']
