"""FedSA-LoRA (Guo et al., 2025): A matrices are shared and averaged; B matrices stay on
each client (client-local state that persists across rounds). Rule for any adapter: the
input-side factor is shared, the output-side one stays local; with VeRA (FedSA-VeRA of
UniFLoW Table 4) λ_d (r per layer) is averaged and λ_b (d_out) stays on the client. A
classifier's head (GLUE) stays on the client by default (fsplug.model.head: local); with
head: shared it is averaged with A."""
from fs_plugins.aggregation.pairs import is_input_factor
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method
from fs_plugins.models.classifier import is_task_head


@register_method
class FedSALoRA(Method):
    name = 'fedsa'
    summary = 'FedSA-LoRA: A averaged, B stays on the client (VeRA: λ_d averaged, λ_b local)'
    sent = 'A / A'

    def is_shared(self, name: str) -> bool:
        return is_input_factor(name) or is_task_head(name)
