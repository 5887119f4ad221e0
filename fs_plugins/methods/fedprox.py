"""FedProx (Li et al., 2020) on the shared LoRA parameters: the local loss gets
mu/2 · ||w − w_global||² over the parameters received from the server this round.

FederatedScope has its own FedProx trainer wrapper (`fedprox.use`); it applies to FS's
trainers, not to the embedded runner, so the proximal term lives here for both runners."""
from dataclasses import dataclass

from fs_plugins.methods.base import Method, load_tensors, proximal_term
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option


@dataclass
class FedProxConfig:
    mu: float = option(0.01, 'proximal weight μ of mu/2 · ‖w − w_global‖²', ge=0)


@register_method
class FedProx(Method):
    name = 'fedprox'
    summary = 'FedAvg + μ/2‖w − w_global‖² on the shared factors'
    sent = 'A, B / A, B'
    config_class = FedProxConfig

    def receive(self, model, content, state):
        load_tensors(model, content)
        state['anchor'] = {n: t.detach().clone() for n, t in content.items()}

    def loss(self, model, batch, state):
        loss = model(**batch).loss
        anchor = state.get('anchor')
        if not anchor:
            return loss
        return loss + 0.5 * self.hparams.mu * proximal_term(model, anchor)
