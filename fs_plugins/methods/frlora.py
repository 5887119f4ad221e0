"""FRLoRA (Yan et al., "Federated Residual Low-Rank Adaption of Large Language Models",
ICLR 2025; code github.com/IAMJackYan/FRLoRA).

- Initialisation, once (Eqs. 6-7): from the SVD W0 = U S Vᵀ of each pretrained target weight,
  A0 = √(S_r/s) V_rᵀ and B0 = U_r √(S_r/s) (top-r triplets; s the LoRA scaling), and the frozen
  base becomes the residual W0 − s·B0 A0, so the starting model is unchanged
  (`fs_plugins.aggregation.lora.principal_factors`). Every process computes the same (A0, B0)
  from the same weights.
- Every round: clients start from (A0, B0) on the current base, train, and send A, B; the
  server averages them and adds s·(B̄ Ā − B0 A0) to the global weight (the residual low-rank
  product; `frlora_step`), which all clients receive; their LoRA is reset to (A0, B0). The
  model after round t is W0 + Σ_τ ΔW_τ (Eq. 13): its update's rank may reach r·t (Eq. 14).
  Other trained tensors (a classifier head with fsplug.model.head: shared) are averaged and kept, not reset.

Options where the paper and its code differ: `exact_product` (Σ p_k B_k A_k instead of B̄ Ā;
they coincide when A is frozen), `freeze_a` (the released trainer trains only B). The code
averages uniformly: `fsplug.aggregation.weights: uniform`. The download is the cumulative
update of each layer, dense (fs_plugins.methods.merged_base); the optimiser starts fresh
each round (the code keeps Adam's moments across the resets)."""
from dataclasses import dataclass

from fs_plugins.aggregation.lora import frlora_step, principal_factors
from fs_plugins.aggregation.pairs import is_lora_a
from fs_plugins.methods.base import Phase, load_tensors
from fs_plugins.methods.merged_base import MergesIntoBase, accumulate, fold_into_base, layer_steps, split_content
from fs_plugins.methods.registry import register_method
from fs_plugins.schema.options import option
from fs_plugins.tuners.mole.model import lora_wrapped_modules

MERGED = 'merged/'   # server -> client: Σ_t (B̄_t Ā_t − B0 A0) of a layer (before s)


@dataclass
class FRLoRAOptions:
    exact_product: bool = option(False, 'sum Σ p_k B_k A_k − B0 A0 into the weights instead of '
                                        "the paper's B̄ Ā − B0 A0 (Algorithm 1: A and B are "
                                        'averaged separately, then multiplied)')
    freeze_a: bool = option(False, 'train only B (A stays A0), as the released code '
                                   '(IAMJackYan/FRLoRA, its FedAvgTrainer) does; the paper '
                                   '(Sec. 3, Algorithm 1) trains both')


@register_method
class FRLoRA(MergesIntoBase):
    name = 'frlora'
    summary = ('FRLoRA: LoRA initialised from the top-r singular triplets of each pretrained '
               'weight; s(B̄Ā − B0A0) summed into the base every round, LoRA reset to (A0, B0)')
    sent = 'A, B / A0, B0 + full-size cumulative update'
    config_class = FRLoRAOptions

    def adapt_model(self, model, cfg):
        for layer in lora_wrapped_modules(model).values():
            weight = layer.base_layer.weight
            scale = layer.scaling['default']
            A0, B0 = principal_factors(weight.detach(), layer.r['default'], scale)
            load_tensors(layer, {'lora_A.default.weight': A0, 'lora_B.default.weight': B0})
            weight.data.copy_((weight.detach().float() - scale * (B0 @ A0)).to(weight.dtype))
        return model

    def phases(self, num_steps, cfg):
        if not self.hparams.freeze_a:
            return [Phase('train', num_steps)]
        return [Phase('train_b', num_steps, trainable=lambda name: not is_lora_a(name))]

    def init_server_state(self, initial_shared):
        # the shared LoRA tensors start at (A0, B0): what every client is reset to
        return {'global': dict(initial_shared), 'merged': {}}

    def aggregate(self, server_state, updates):
        start = server_state['global']

        def residual_product(prefix, keys, As, Bs, weights):
            return frlora_step(As, Bs, weights, start[keys[0]], start[keys[1]],
                               self.hparams.exact_product)
        others, steps = layer_steps(updates, residual_product)
        return {'global': {**start, **others},
                'merged': accumulate(server_state['merged'], steps)}

    def content_for(self, server_state, client_id):
        return {**server_state['global'],
                **{MERGED + k: v for k, v in server_state['merged'].items()}}

    def receive(self, model, content, state):
        plain, merged = split_content(content, MERGED)
        load_tensors(model, plain)   # the LoRA back to (A0, B0)
        fold_into_base(model, state, merged, scaled=True)
