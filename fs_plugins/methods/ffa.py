"""FFA-LoRA (Sun et al., 2024): A stays frozen at its (seeded, hence common) initialisation;
only B is trained, sent and averaged, so the average of B·A equals (average B)·A exactly."""
from fs_plugins.aggregation.pairs import is_lora_a
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method


@register_method
class FFALoRA(Method):
    name = 'ffa'
    summary = 'FFA-LoRA: A frozen at its (common, seeded) init, only B trained and averaged'
    sent = 'B / B'

    def adapt_model(self, model, cfg):
        for name, param in model.named_parameters():
            if is_lora_a(name):
                param.requires_grad_(False)
        return model
