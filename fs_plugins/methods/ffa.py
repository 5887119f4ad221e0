"""FFA-LoRA (Sun et al., 2024): A stays frozen at its (seeded, hence common) initialisation;
only B is trained, sent and averaged, so the average of B·A equals (average B)·A exactly.

Rule for any adapter: freeze the input-side factor, train the output-side one (the one peft
initialises at zero; freezing it instead would keep ΔW = 0). With VeRA (FFA-VeRA of UniFLoW
Table 4), ΔW = diag(λ_b) B diag(λ_d) A: λ_d stays frozen at its common d_initial and only λ_b
trains, so ΔW_k = diag(λ_b,k) M with one M = B diag(λ_d) A for all clients, and averaging
λ_b again averages the updates exactly."""
from fs_plugins.aggregation.pairs import is_input_factor
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method


@register_method
class FFALoRA(Method):
    name = 'ffa'
    summary = ('FFA-LoRA: A frozen at its (common, seeded) init, only B trained and averaged '
               '(VeRA: λ_d frozen, λ_b trained)')
    sent = 'B / B'

    def adapt_model(self, model, cfg):
        for name, param in model.named_parameters():
            if is_input_factor(name):
                param.requires_grad_(False)
        return model
