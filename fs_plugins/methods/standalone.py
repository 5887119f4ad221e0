"""Standalone: each client trains only on its own data; nothing is communicated."""
from fs_plugins.methods.base import ClientUpdate, Method
from fs_plugins.methods.registry import register_method


@register_method
class Standalone(Method):
    name = 'standalone'
    summary = 'each client trains on its own data only'
    sent = 'nothing / nothing'

    def is_shared(self, name: str) -> bool:
        return False

    def aggregate(self, server_state: dict, updates: list[ClientUpdate]) -> dict:
        return server_state

    def content_for(self, server_state: dict, client_id: int) -> dict:
        return {}
