"""DITTO (Li et al., ICML 2021, "Ditto: Fair and Robust Federated Learning through
Personalization", Algorithm 1) with LoRA adapters, as FedMosaic's tables use it (A.9:
"dual adapter").

Every client holds the global adapter w ('default': trained on the client's data, sent,
averaged by the server) and a personalised adapter v_k ('personal': never sent), each a full
model on its own (only one is active at a time). A local round first updates w for one
local pass with the plain loss F_k(w), then v_k for one more pass with
F_k(v_k) + λ/2‖v_k − w^t‖², where w^t is the global adapter received at the round's start
(Algorithm 1 line 6: the proximal point is the server's model, not the locally updated one).
v_k starts as a copy of w (v_k⁰ = w⁰). Evaluation and saved models use v_k. Trained tensors
outside the adapters (e.g. LLaVA's projector) belong to the global model: they train in the
global pass and are averaged.
"""
from dataclasses import dataclass

from fs_plugins.methods.base import Method, Phase, activate_adapters, copy_adapter, load_tensors, proximal_term
from fs_plugins.methods.dual_adapter import add_twin_adapter, needs_lora_adapter
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

GLOBAL, PERSONAL = 'default', 'personal'


def is_personal(name: str) -> bool:
    return f'.{PERSONAL}.' in name


@dataclass
class DittoConfig:
    lam: float = option(1.0, "λ of λ/2‖v_k − w‖² pulling the personal adapter to the received "
                             "global one (DITTO tunes it in {0.01, 0.1, 1, 2})", ge=0)


@register_method
class Ditto(Method):
    name = 'ditto'
    summary = ('DITTO: a global LoRA (FedAvg) and a personal LoRA trained after it with '
               'λ/2‖v − w‖² to the received global; evaluation uses the personal one')
    sent = 'global A, B / global A, B'
    config_class = DittoConfig
    inference_adapters = (PERSONAL,)
    # FedMosaic Table 15: "Double Forward/Backward", 2.000 × SFT (a global and a personal pass)
    relative_cost = 2.0
    paper_relative_cost = 2.0

    @classmethod
    def config_problems(cls, hparams, cfg):
        return needs_lora_adapter(cls.name, cfg)

    def adapt_model(self, model, cfg):
        add_twin_adapter(model, PERSONAL)
        copy_adapter(model, GLOBAL, PERSONAL)
        activate_adapters(model, self.inference_adapters)
        return model

    def is_shared(self, name):
        return not is_personal(name)

    def phases(self, num_steps, cfg):
        return [Phase('global', num_steps, lambda n: not is_personal(n), adapters=(GLOBAL,)),
                Phase('personal', num_steps, is_personal, adapters=(PERSONAL,))]

    def receive(self, model, content, state):
        load_tensors(model, content)
        state['anchor'] = {n.replace(f'.{GLOBAL}.', f'.{PERSONAL}.'): t.detach().clone()
                           for n, t in content.items() if f'.{GLOBAL}.' in n}

    def proximal_coefficient(self) -> float:
        """The factor of ‖v_k − w‖² in the personal adapter's loss: λ/2."""
        return 0.5 * self.hparams.lam

    def loss(self, model, batch, state):
        loss = model(**batch).loss
        if PERSONAL not in model.base_model.active_adapters or not state.get('anchor'):
            return loss
        return loss + self.proximal_coefficient() * proximal_term(model, state['anchor'])
