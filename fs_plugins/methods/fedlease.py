"""FedLEASE (Wang, Bian, Zhang, Xu, "Adaptive LoRA Experts Allocation and Selection for Federated
Fine-Tuning", NeurIPS 2025, arXiv 2509.15087; code github.com/lei-wang-link/FedLEASE).

1. Warm-up (`warmup_rounds`, counted in federate.total_round_num; the code's 5 of 25): every
   client trains its own LoRA; nothing is aggregated.
2. After the last warm-up round the server clusters the clients by their LoRA B matrices
   (Eq. 2: mean over layers of 1 − cosine; `fs_plugins.aggregation.clustering`), average-linkage
   agglomerative clustering for k = 2 .. min(max_experts, clients − 1), keeping the k of the
   best silhouette: M experts. Expert j starts as the mean of its cluster's LoRAs (Eq. 3).
3. Afterwards a client of cluster c holds all M experts at every LoRA layer: its own (peft's
   adapter, trained) and the others (frozen), mixed per token by its router over 2M − 1 slots,
   top-M (`fs_plugins.tuners.lease`). It trains its own expert and its router (in warm-up only
   its LoRA: the router has nothing to choose from yet); the server
   averages each expert, and each router, within its cluster, and every client downloads all
   experts. Clustering happens once.

Choices where the paper leaves room (each visible in the config or here):
- averages use fsplug.aggregation.weights (the code averages uniformly: set it to 'uniform');
- `router_aggregation: local` keeps each client's router on the client;
- trained tensors besides LoRA (e.g. a projector) belong to the client's cluster, like its
  expert (the code keeps its classifier per client and frozen);
- a client the server has not seen by the end of warm-up (partial participation) trains its own
  LoRA until its first update, which joins it to the expert nearest by Eq. 2.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.clustering import b_distances, choose_clusters, nearest_cluster
from fs_plugins.aggregation.pairs import lora_pairs
from fs_plugins.methods.base import Contract, Method, Phase, differing_client_keys, load_tensors, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option
from fs_plugins.tuners.lease import inject_lease, is_lease_router, lease_layers

logger = logging.getLogger(__name__)

CLUSTER = 'fedlease/cluster'       # server -> client: the client's expert
OTHERS_A = 'fedlease/others_A/'    # server -> client: the other experts' A of a layer, stacked
OTHERS_B = 'fedlease/others_B/'


@dataclass
class FedLEASEConfig:
    warmup_rounds: int = option(5, 'rounds of local LoRA training without aggregation before the '
                                   'clustering, counted in federate.total_round_num (code: 5 of '
                                   '25)', ge=1)
    max_experts: int = option(8, 'M_max: the clustering tries 2 .. min(M_max, clients − 1) '
                                 'experts (paper 8; code 4)', ge=2)
    router_aggregation: str = option('cluster', "cluster: each router is averaged within its "
                                                "client's cluster (code: route_aggregation); "
                                                'local: each client keeps its router',
                                     choices=('cluster', 'local'))


def b_matrices(shared: dict) -> dict[str, torch.Tensor]:
    """{layer prefix: B} of an update's LoRA layers."""
    return {prefix: shared[keys[1]] for prefix, keys in lora_pairs(shared).items()}


def load_other_experts(model, tensors: dict) -> None:
    """Sets each layer's other experts from `tensors` (content or a saved model) where given."""
    for prefix, layer in lease_layers(model).items():
        if OTHERS_A + prefix in tensors:
            layer.set_experts(tensors[OTHERS_A + prefix], tensors[OTHERS_B + prefix])


@register_method
class FedLEASE(Method):
    name = 'fedlease'
    summary = ('FedLEASE: local LoRA warm-up, clients clustered by their B matrices (silhouette '
               'picks M), one LoRA expert per cluster; each client mixes all M experts with its '
               'router (2M−1 slots, top-M), trains its own expert + router, averaged per cluster')
    sent = 'own expert A, B + routers / all M experts + routers'
    contract = Contract(audit_clients=3)   # choosing 2 or 3 clusters by silhouette needs three
    config_class = FedLEASEConfig
    hf_export_refusal = 'its routers and other experts are modules of its own'

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = []
        if cfg['fsplug']['model']['adapter'] != 'lora':
            problems.append(f"fsplug.model.adapter = {cfg['fsplug']['model']['adapter']!r}: "
                            f"fedlease needs 'lora' (its experts are LoRA adapters)")
        rounds = int(cfg['federate']['total_round_num'])
        if hparams.warmup_rounds > rounds:
            problems.append(f'fsplug.fedlease.warmup_rounds = {hparams.warmup_rounds}: must be <= '
                            f'federate.total_round_num = {rounds}, or the clients are never '
                            f'clustered')
        clients = int(cfg['federate'].get('client_num') or 0)
        if 0 < clients < 3:
            problems.append(f'federate.client_num = {clients}: fedlease chooses 2 .. clients − 1 '
                            f'experts, so it needs at least 3 clients')
        return problems

    @classmethod
    def client_problems(cls, run_cfg, client_cfg):
        lora = ('fsplug', 'model', 'lora')
        return differing_client_keys(
            run_cfg, client_cfg, [lora + ('r',), lora + ('alpha',), lora + ('target_modules',),
                                  ('fsplug', cls.name)],
            'FedLEASE exchanges LoRA experts between clients, so they must have the same shape')

    def capacity(self, cfg) -> int:
        """Experts a layer can hold: M_max, and at most clients − 1."""
        clients = int(cfg.federate.client_num or 0)
        return min(self.hparams.max_experts, clients - 1) if clients >= 3 else self.hparams.max_experts

    # ------------------------------------------------------------------ client
    def adapt_model(self, model, cfg):
        inject_lease(model, self.capacity(cfg))
        for name, param in model.named_parameters():
            if is_lease_router(name):
                param.requires_grad_(True)
        return model

    def phases(self, num_steps, cfg):
        """Warm-up rounds train the client's own LoRA only: with no other expert yet, the router
        has one slot and no gradient (it is still sent, so every update has one layout)."""
        if self.round_idx < self.hparams.warmup_rounds:
            return [Phase('warmup', num_steps, lambda name: not is_lease_router(name))]
        return [Phase('train', num_steps)]

    def receive(self, model, content, state):
        cluster = content.get(CLUSTER)
        load_tensors(model, {k: v for k, v in content.items() if not k.startswith('fedlease/')})
        if cluster is not None:
            state['cluster'] = int(cluster)
            load_other_experts(model, content)

    def client_metrics(self, model, state):
        if 'cluster' not in state:
            return {}
        return {'fedlease_cluster': state['cluster'],
                'fedlease_experts': next(iter(lease_layers(model).values())).active}

    def artifact_extra(self, model, state):
        """The other experts in use, named as the server sends them (none before clustering)."""
        extra = {}
        for prefix, layer in lease_layers(model).items():
            if layer.active > 1:
                extra[OTHERS_A + prefix] = layer.bank_A[:layer.active - 1]
                extra[OTHERS_B + prefix] = layer.bank_B[:layer.active - 1]
        return extra

    def restore_artifact(self, model, extra):
        load_other_experts(model, extra)

    # ------------------------------------------------------------------ server
    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'rounds': 0, 'warmup': {}, 'assignment': {},
                'experts': {}, 'silhouette': {}}

    def aggregate(self, server_state, updates):
        state = {**server_state, 'rounds': server_state['rounds'] + 1}
        if not state['assignment']:
            state['warmup'] = {**state['warmup'], **{u.client_id: {'shared': u.shared,
                                                                 'weight': w}
                                                     for u, w in zip(updates, weights_of(updates))}}
            if state['rounds'] >= self.hparams.warmup_rounds:
                state = self.cluster(state)
            return state
        assignment = dict(state['assignment'])
        for update in updates:
            if update.client_id not in assignment:
                centres = [b_matrices(state['experts'][j]) for j in sorted(state['experts'])]
                assignment[update.client_id] = nearest_cluster(b_matrices(update.shared), centres)
        experts = dict(state['experts'])
        for j in experts:
            members = [u for u in updates if assignment[u.client_id] == j]
            if members:
                experts[j] = {**experts[j], **weighted_average([self.clustered(u.shared)
                                                                for u in members],
                                                               weights_of(members))}
        return {**state, 'assignment': assignment, 'experts': experts}

    def cluster(self, state: dict) -> dict:
        """Eq. 2-3 on the warm-up LoRAs: clusters, and each cluster's mean as its expert."""
        ids = sorted(state['warmup'])
        labels, scores = choose_clusters(
            b_distances([b_matrices(state['warmup'][i]['shared']) for i in ids]),
            self.capacity(self.cfg))
        experts = {}
        for j in sorted(set(labels)):
            members = [i for i, label in zip(ids, labels) if label == j]
            experts[j] = weighted_average([self.clustered(state['warmup'][i]['shared'])
                                           for i in members],
                                          [state['warmup'][i]['weight'] for i in members])
        logger.info(f'fsplug: FedLEASE clustered clients {ids} into {len(experts)} experts '
                    f'{labels} (silhouette by k: '
                    f"{', '.join(f'{k}: {s:.3f}' for k, s in scores.items())})")
        return {**state, 'warmup': {}, 'assignment': dict(zip(ids, labels)), 'experts': experts,
                'silhouette': scores}

    def clustered(self, shared: dict) -> dict:
        """What a cluster holds of an update: everything, or everything but the routers."""
        if self.hparams.router_aggregation == 'cluster':
            return shared
        return {k: v for k, v in shared.items() if not is_lease_router(k)}

    def content_for(self, server_state, client_id):
        if server_state['rounds'] == 0:
            return server_state['global']
        cluster = server_state['assignment'].get(client_id)
        if cluster is None:   # warming up, or not seen before the clustering
            return {}
        experts = server_state['experts']
        others = [experts[j] for j in sorted(experts) if j != cluster]
        content = {**experts[cluster], CLUSTER: torch.tensor(cluster)}
        for prefix, (a_key, b_key) in lora_pairs(experts[cluster]).items():
            content[OTHERS_A + prefix] = torch.stack([e[a_key] for e in others])
            content[OTHERS_B + prefix] = torch.stack([e[b_key] for e in others])
        return content
