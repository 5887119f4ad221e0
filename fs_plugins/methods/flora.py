"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
Low-Rank Adaptations", NeurIPS 2024; code github.com/ATP-1010/FederatedLLM).

Each round the server stacks the clients' factors, A = [p_1 s_1 A_1; …; p_K s_K A_K] and
B = [B_1, …, B_K] (Sec. 3, `fs_plugins.aggregation.lora.flora_stack`), so that the merged update
B A = Σ_k p_k s_k B_k A_k is exact (no cross terms) at any mix of ranks r_k, and merges it into
the base weight; every client then starts the next round from a fresh LoRA (A Kaiming-uniform,
B = 0, as peft initialises it). p_k: the round's sample shares (fsplug.aggregation.weights);
s_k = α_k / r_k: each client's own LoRA scaling, sent with its update (the paper's code relies
on α_k = 2 r_k instead). Non-LoRA trained tensors (e.g. a classifier head with
fsplug.model.head: shared) are averaged.

Choices where the paper leaves room:
- the fresh A of a round is the same on every client (as if the server created the round's
  LoRA), drawn from a seed of the run seed and the number of rounds merged so far;
- the download is the cumulative merged update of each layer (dense, d_out × d_in), which equals
  the product of the stacked factors, rather than the stack itself: a client that skipped
  rounds catches up exactly (fs_plugins.methods.merged_base);
- the optimiser starts fresh every round (as the code's new Trainer per round does)."""
import math

import torch

from fs_plugins.aggregation.lora import flora_stack
from fs_plugins.aggregation.pairs import is_lora_factor
from fs_plugins.core.seeding import derive_seed
from fs_plugins.methods.base import Contract, load_tensors
from fs_plugins.methods.merged_base import MergesIntoBase, accumulate, fold_into_base, layer_steps, split_content
from fs_plugins.methods.registry import register_method
from fs_plugins.tuners.mole.model import lora_wrapped_modules

MERGED = 'merged/'          # server -> client: cumulative Σ_t Σ_k p_k s_k B_k A_k of a layer
SCALE = 'scale/'            # client -> server: the layer's LoRA scaling s_k
ROUNDS_MERGED = 'flora/rounds_merged'


@register_method
class FLoRA(MergesIntoBase):
    name = 'flora'
    summary = ('FLoRA: clients\' A and B stacked so the update is exactly Σp_ks_kB_kA_k at any '
               'ranks, merged into the base each round; fresh LoRA every round')
    sent = 'own-rank A, B / full-size merged update'
    contract = Contract(extra=(SCALE + '*',))

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'merged': {}, 'rounds_merged': 0}

    def client_extra(self, model, state):
        return {SCALE + prefix: torch.tensor(float(layer.scaling['default']))
                for prefix, layer in lora_wrapped_modules(model).items()}

    def extra_payload_shapes(self, model, cfg):
        """One scalar LoRA scaling per LoRA-wrapped layer."""
        return {SCALE + prefix: () for prefix in lora_wrapped_modules(model)}

    def aggregate(self, server_state, updates):
        def stacked_product(prefix, keys, As, Bs, weights):
            A, B = flora_stack(As, Bs, weights, [float(u.extra[SCALE + prefix]) for u in updates])
            return B.float() @ A.float()
        others, steps = layer_steps(updates, stacked_product)
        return {'global': {**server_state['global'], **others},
                'merged': accumulate(server_state['merged'], steps),
                'rounds_merged': server_state['rounds_merged'] + 1}

    def content_for(self, server_state, client_id):
        plain = {k: v for k, v in server_state['global'].items() if not is_lora_factor(k)}
        return {**plain, ROUNDS_MERGED: torch.tensor(server_state['rounds_merged']),
                **{MERGED + k: v for k, v in server_state['merged'].items()}}

    def receive(self, model, content, state):
        plain, merged = split_content(content, MERGED)
        rounds_merged = plain.pop(ROUNDS_MERGED, None)   # absent: not the server's state (FS's finish)
        load_tensors(model, plain)
        fold_into_base(model, state, merged, scaled=False)
        if rounds_merged is not None:
            fresh_lora(model, derive_seed(self.cfg.seed, 'flora', int(rounds_merged)))


def fresh_lora(model, seed: int) -> None:
    """peft's initialisation of every LoRA layer (A Kaiming-uniform with a = √5, B = 0), drawn
    from `seed` layer by layer in module order."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_wrapped_modules(model).values():
            a = layer.lora_A['default'].weight
            fresh = torch.empty(a.shape, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
            a.copy_(fresh.to(a.device, a.dtype))
            layer.lora_B['default'].weight.zero_()
