"""Test-only methods exercising every extension point of the method contract.

`toy_phased`:
- (a) client-local parameters: lora_B never leaves the client; lora_A is shared;
- (b) two phases per round: lora_A first, then lora_B;
- (c) extra payload: a per-client step counter kept in client state (optimiser-independent);
      personalised download: each client gets the average of the OTHER clients' lora_A;
- (e) server state: how many rounds it aggregated and the counters it last received.
"""
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.methods import Method, Phase, register_method
from fs_plugins.schema import option


@dataclass
class ToyPhasedConfig:
    first_phase_steps: int = option(1, 'local steps of the first phase (lora_A trains)', ge=0)
    fail_at_round: int = option(-1, 'raise in aggregation at this round (-1: never)', ge=0,
                                special=(-1,))


@register_method
class ToyPhased(Method):
    name = 'toy_phased'
    summary = ('test-only example: lora_A shared, lora_B kept; two phases; a step counter as '
               "extra payload; each client receives the average of the others' lora_A")
    sent = "lora_A + counter / others' average lora_A"
    config_class = ToyPhasedConfig

    def is_shared(self, name):
        return 'lora_A' in name

    def phases(self, num_steps, cfg):
        first = min(self.hparams.first_phase_steps, num_steps)
        return [Phase('A', first, lambda n: 'lora_A' in n),
                Phase('B', num_steps - first, lambda n: 'lora_B' in n)]

    def init_client_state(self, model, cfg):
        return {'steps_total': 0}

    def after_step(self, model, state):
        state['steps_total'] += 1

    def client_extra(self, model, state):
        return {'steps_total': torch.tensor([state['steps_total']], dtype=torch.int64)}

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'per_client': {}, 'rounds': 0, 'counters': {}}

    def aggregate(self, server_state, updates):
        fail_at = self.hparams.fail_at_round
        if fail_at >= 0 and server_state['rounds'] == fail_at:
            raise RuntimeError(f'toy_phased: planned failure at round {fail_at}')
        per_client = dict(server_state['per_client'])
        for update in updates:
            per_client[update.client_id] = (update.num_samples, update.shared)
        merged = weighted_average([s for _, s in per_client.values()],
                                  [n for n, _ in per_client.values()])
        return {'global': {**server_state['global'], **merged}, 'per_client': per_client,
                'rounds': server_state['rounds'] + 1,
                'counters': {u.client_id: int(u.extra['steps_total'][0]) for u in updates}}

    def content_for(self, server_state, client_id):
        others = [(n, s) for cid, (n, s) in server_state['per_client'].items() if cid != client_id]
        if not others:
            return server_state['global']
        return weighted_average([s for _, s in others], [n for n, _ in others])
