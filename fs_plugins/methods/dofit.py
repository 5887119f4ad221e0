"""DoFIT (Xu et al., "DoFIT: Domain-aware Federated Instruction Tuning with Alleviated
Catastrophic Forgetting", NeurIPS 2024; code github.com/1xbq1/DoFIT).

The clients form domains (`domains`: each client's domain label). Every round:
1. intra-domain: FedAvg of the domain's clients (fsplug.aggregation.weights), one LoRA per domain;
2. inter-domain (`fs_plugins.aggregation.domains.dofit_inter_domain`): each domain's `top_k` most
   important LoRA units by squared norm, their overlap across domains averaged uniformly over the
   domains, and each domain's overlapping units re-initialised: `init: proximal` (DoFIT's
   proximal perturbation, θ_d + λ|θ_d − θ̄|/‖θ_d − θ̄‖ as the released code computes it) or
   `init: assign` (DoFIT-base, θ_d ← θ̄). Other units keep their intra-domain value.
A client trains and is evaluated on its domain's LoRA. Tensors besides LoRA (e.g. a projector)
are averaged within the domain only.

Where the paper and its code leave room: `granularity` scores single tensors (the code: every
lora_A and lora_B on its own) or a layer's (A, B) pair together; domains without an update this
round keep their LoRA and still take part in the inter-domain step (the code samples clients of
every domain every round).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.domains import GRANULARITIES, INITS, dofit_inter_domain
from fs_plugins.methods.base import Contract, Method, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

logger = logging.getLogger(__name__)


@dataclass
class DoFITConfig:
    domains: list[int] = option([], "each client's domain label, in client-id order (client 1 "
                                    'first); at least two domains, e.g. [0, 0, 1, 1]')
    top_k: int = option(15, 'k: the most important LoRA units of each domain (the code: 15, of 64 '
                            'tensors with LoRA on down_proj of a 32-layer model)', ge=1)
    init: str = option('proximal', 'overlapping units: proximal (DoFIT, the released code\'s '
                                   "proximal perturbation) | assign (DoFIT-base)", choices=INITS)
    perturbation_scale: float = option(1.0, 'λ of the proximal perturbation (the code: 1.0)', ge=0)
    granularity: str = option('tensor', 'a unit is one LoRA tensor (the code) or one layer\'s '
                                        '(A, B) pair (module)', choices=GRANULARITIES)


@register_method
class DoFIT(Method):
    name = 'dofit'
    summary = ('DoFIT: FedAvg within each domain, then the LoRA units in every domain\'s top-k '
               'by squared norm are averaged across domains and re-initialise each domain '
               '(proximal perturbation, or assigned for DoFIT-base)')
    sent = "A, B / the domain's A, B"
    config_class = DoFITConfig
    contract = Contract(per_client_options=('domains',))

    @classmethod
    def config_problems(cls, hparams, cfg):
        domains, clients = hparams.domains, int(cfg['federate'].get('client_num') or 0)
        if len(set(domains)) < 2:
            return [f'fsplug.dofit.domains = {domains}: give each client its domain label, with at '
                    f'least two domains (one domain is FedAvg)']
        if clients and len(domains) != clients:
            return [f'fsplug.dofit.domains has {len(domains)} labels but federate.client_num = '
                    f'{clients}: one label per client']
        return []

    def domain_of(self, client_id: int) -> int:
        domains = self.hparams.domains
        if not 1 <= client_id <= len(domains):
            raise ValueError(f'Client {client_id} has no domain: fsplug.dofit.domains lists '
                             f'{len(domains)} clients')
        return domains[client_id - 1]

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared),
                'domains': {d: dict(initial_shared) for d in sorted(set(self.hparams.domains))},
                'overlap': []}

    def aggregate(self, server_state, updates):
        domains = dict(server_state['domains'])
        for d in domains:
            members = [u for u in updates if self.domain_of(u.client_id) == d]
            if members:
                domains[d] = {**domains[d],
                              **weighted_average([u.shared for u in members], weights_of(members))}
        labels = sorted(domains)
        hp = self.hparams
        states, overlap = dofit_inter_domain([domains[d] for d in labels], hp.top_k, hp.init,
                                             hp.perturbation_scale, hp.granularity)
        logger.debug(f'fsplug: DoFIT overlap of the domains\' top-{hp.top_k}: {overlap}')
        return {**server_state, 'domains': dict(zip(labels, states)), 'overlap': overlap}

    def content_for(self, server_state, client_id):
        return server_state['domains'][self.domain_of(client_id)]
