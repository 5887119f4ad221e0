"""Standalone: each client trains only on its own data; nothing is communicated. With
`full_finetune` (as FedAvg's, fs_plugins/methods/fedavg.py) every weight trains instead of LoRA."""
from fs_plugins.methods.base import ClientUpdate, Method
from fs_plugins.methods.fedavg import FullFinetuneConfig, FullFinetuneOption
from fs_plugins.methods.registry import register_method


class NothingSent(Method):
    """A method whose clients upload nothing and receive nothing (standalone, zero_shot)."""

    def is_shared(self, name: str) -> bool:
        return False

    def aggregate(self, server_state: dict, updates: list[ClientUpdate]) -> dict:
        return server_state

    def content_for(self, server_state: dict, client_id: int) -> dict:
        return {}


@register_method
class Standalone(NothingSent, FullFinetuneOption):
    name = 'standalone'
    summary = ('each client trains on its own data only '
               '(fsplug.standalone.full_finetune: every weight, no LoRA)')
    sent = 'nothing / nothing'
    config_class = FullFinetuneConfig
