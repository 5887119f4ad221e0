"""FedAvg over the LoRA parameters, weighted by the samples each client trained on.

Everything trainable is shared; the server averages and broadcasts the same state to all.
The behaviour is the `Method` base class's; this module only names it."""
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method


@register_method
class FedAvg(Method):
    name = 'fedavg'
    summary = 'FedAvg over all LoRA factors, weighted by samples trained'
    sent = 'A, B / A, B'
