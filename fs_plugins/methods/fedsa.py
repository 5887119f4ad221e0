"""FedSA-LoRA (Guo et al., 2025): A matrices are shared and averaged; B matrices stay on
each client (client-local state that persists across rounds)."""
from fs_plugins.aggregation.pairs import is_lora_a
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method


@register_method
class FedSALoRA(Method):
    name = 'fedsa'
    summary = 'FedSA-LoRA: A averaged, B stays on the client'
    sent = 'A / A'

    def is_shared(self, name: str) -> bool:
        return is_lora_a(name)
