"""FedMKT (Fan et al., COLING 2025, "FedMKT: Federated Mutual Knowledge Transfer for Large and
Small Language Models"), built from the paper as FedMosaic describes and runs it (§5, A.6:
"Federated distillation baselines (i.e., TAKFL, PerAda, and FedMKT) share knowledge between
heterogeneous models via logits"; §2: FedMKT "uses those [logits] with the lowest loss").

Every model (the clients' small models, the server's model) carries LoRA. A round:
1. Each client k trains its LoRA θ_k on its private data (CE) and uploads it.
2. On the labelled public set D_p (the same records for everyone, each model tokenising them
   with its own tokenizer), the server computes, for each client and for its own model θ_s,
   the per-sample answer loss ℓ(x) (mean next-token CE over the answer) and the next-token
   logits z(x) at the end of the prompt.
3. Token alignment (MinED): every client token is mapped to the server token at the minimum
   edit distance (and back), and a teacher's distribution p = softmax(z/T) is carried over to
   the student's vocabulary by summing the mass mapped onto each student token
   (aggregation.fedmkt.align_probabilities).
4. Client → server, selective (dual minimum CE): per sample, the teacher is the client with
   the lowest ℓ_k(x), kept only when ℓ_k(x) < ℓ_s(x). θ_s trains on
   L_s = (1 − λ)·CE_s(x) + λ·KL(q_k*(x) ‖ softmax(z_s(x)/T))·1[kept].
5. Server → client, selective: with the distilled θ_s, each client's θ_k trains on
   L_k = (1 − λ)·CE_k(x) + λ·KL(q_s(x) ‖ softmax(z_k(x)/T))·1[ℓ_s(x) < ℓ_k(x)],
   and client k receives its θ_k for the next round (its adapter is never averaged).
The server's θ_s is the largest model among the run's and the clients' (server_model
'largest', FedMKT's large server LLM; 'run': the run's model.type). When it is the run's model
its LoRA is the run's saved global state; another server model keeps its LoRA in the server
state ('server'), the global staying the run's initial adapter.

Choices (the paper cannot be read here):
- Step 5 runs on the server, from the client's uploaded θ_k on a server-side copy of its
  architecture: the same public data, starting adapter and loss give the adapter the client
  would compute; what travels is each client's LoRA (up and down) instead of public-set logits.
- The distilled distribution is the next-token one at the end of each public prompt (as
  PerAda here), not every answer position (FedMKT aligns whole sequences): positions need no
  sequence alignment across tokenizers.
- The server-side model copies, public batches, token alignment, measuring pass and
  optimisation loop are shared with TAKFL (methods/server_models.py).
- The teachers' selection uses the losses measured once at the start of each direction.
- Distillation only on the selected rows (kd_weight 1, the authors'), at the training rate
  (kd_lr 0 = train.optimizer.lr); T, Adam and one pass over the public set per direction
  (kd_epochs) are this implementation's defaults.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation.fedmkt import (
    align_probabilities,
    answer_losses,
    prompt_end_rows,
    select_teachers,
    selective_kd_loss,
)
from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.server_models import ServerModels
from fs_plugins.schema import option

logger = logging.getLogger(__name__)


@dataclass
class FedMKTConfig:
    kd_weight: float = option(1.0, 'λ of (1 − λ)·CE + λ·KD in both distillation directions; 1 = '
                                   "the authors': distillation only, on the public rows whose "
                                   "teacher was selected (dual minimum CE); below 1 adds CE on "
                                   'every public row (an earlier choice of ours)',
                              ge=0, le=1)
    kd_epochs: int = option(1, 'passes over the public set per direction and round (server '
                               'model from the clients, then each client from the server)', ge=1)
    kd_batch_size: int = option(8, 'public records per distillation batch', ge=1)
    kd_lr: float = option(0.0, 'Adam learning rate of the distillation steps; 0 = the training '
                               "rate (train.optimizer.lr), as FedMKT's distillation trains at its "
                               'fine-tuning rate', ge=0)
    kd_temperature: float = option(1.0, 'T of KL(q ‖ softmax(z/T)), q the teacher\'s '
                                        'softmax(z_t/T) aligned to the student\'s vocabulary', gt=0)
    public_data: str = option('held_out', 'labelled public data shared by the server and the '
                                          "clients (FedMKT's public set): a .json/.jsonl record "
                                          'file, a builtin dataset name (its train records), '
                                          "'held_out' (public_samples training records of the "
                                          "run's data held apart from every client: "
                                          "fsplug.data.public_holdout) or 'clients' (the clients' "
                                          'own training records, explicitly)')
    public_samples: int = option(256, 'public records used (a seeded choice)', ge=2)
    server_model: str = option('largest', "the server's model: 'largest' = the largest model "
                                          "(parameters) among the run's and the clients' (FedMKT's "
                                          'server LLM is the largest; FedMosaic A.6); '
                                          "'run' = the run's model.type",
                               choices=('largest', 'run'))


@register_method
class FedMKT(ServerModels):
    name = 'fedmkt'
    summary = ('FedMKT: clients train LoRA locally; the server distils them into its own LoRA model '
               'and back on public data (MinED token alignment, a teacher kept only where its loss '
               'is lower); each client receives its distilled LoRA')
    sent = 'A, B / the client\'s distilled A, B'
    config_class = FedMKTConfig
    robust_aggregation_refusal = 'nothing is averaged: the server distils logits between models'
    # FedMosaic Table 15: "Public data Logit Share", memory 1.002, compute 1.574 × SFT
    relative_cost = 1.574
    paper_relative_cost = 1.574

    # ------------------------------------------------------------------ server
    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'clients': {}, 'rounds': 0}

    def content_for(self, server_state, client_id):
        # before its first distillation a client keeps its own initial adapter
        return server_state['clients'].get(str(client_id), {})

    def aggregate(self, server_state, updates):
        rounds = server_state['rounds']
        run_key = self.architecture(self.cfg)
        client_keys = {u.client_id: self.architecture(self.client_configs.get(u.client_id, self.cfg))
                       for u in updates}
        server_key = self.server_key(run_key, client_keys.values())
        # the run's model keeps its LoRA as the saved global; another server model its own
        start = (server_state['global'] if server_key == run_key
                 else server_state.get('server') or self.initial_lora(server_key))
        client_views = {u.client_id: self.measure(client_keys[u.client_id], u.shared)
                        for u in updates}
        server_view = self.measure(server_key, start)
        server_lora = self.server_from_clients(server_key, start, server_view,
                                               client_keys, client_views, rounds)
        server_losses, server_logits = self.measure(server_key, server_lora)
        server_probs = torch.softmax(server_logits / self.hparams.kd_temperature, -1)
        clients = dict(server_state['clients'])
        for update in updates:
            key = client_keys[update.client_id]
            client_losses, client_logits = client_views[update.client_id]
            teacher = align_probabilities(server_probs, self.alignment(server_key, key),
                                          client_logits.shape[-1])
            clients[str(update.client_id)] = self.distil(
                key, update.shared, teacher, server_losses < client_losses,
                ('fedmkt-kd', rounds, 'client', update.client_id))
        if server_key == run_key:
            return {**server_state, 'global': {**server_state['global'], **server_lora},
                    'clients': clients, 'rounds': rounds + 1}
        return {**server_state, 'server': server_lora, 'clients': clients, 'rounds': rounds + 1}

    def server_key(self, run_key: str, client_keys) -> str:
        """The server model's architecture key: the run's ('run'), or the largest model among
        the run's and the clients' ('largest'; ties to the run's, then the first)."""
        if self.hparams.server_model == 'run':
            return run_key
        keys = [run_key] + [k for k in dict.fromkeys(client_keys) if k != run_key]
        sizes = [self.model_size(k) for k in keys]
        return keys[sizes.index(max(sizes))]

    def server_from_clients(self, server_key, server_lora, server_view, client_keys,
                            client_views, round_idx: int) -> dict:
        """The server's LoRA distilled from the clients: per public sample the client with the
        lowest loss, kept where it beats the server's (dual minimum CE)."""
        server_losses, server_logits = server_view
        temperature = self.hparams.kd_temperature
        aligned = torch.stack([
            align_probabilities(torch.softmax(logits / temperature, -1),
                                self.alignment(client_keys[cid], server_key),
                                server_logits.shape[-1])
            for cid, (_, logits) in client_views.items()])
        teacher_losses = torch.stack([losses for losses, _ in client_views.values()])
        index, keep = select_teachers(teacher_losses, server_losses)
        teacher = aligned[index, torch.arange(index.shape[0])]
        logger.info(f'FedMKT: the clients teach the server on {int(keep.sum())} of '
                    f'{keep.shape[0]} public samples')
        return self.distil(server_key, server_lora, teacher, keep,
                           ('fedmkt-kd', round_idx, 'server'))

    def distil(self, key: str, lora: dict, teacher: torch.Tensor, keep: torch.Tensor,
               seed_tags: tuple) -> dict:
        """`lora` on model `key` trained for kd_epochs passes over the public set on
        (1 − λ)·CE + λ·selective KD towards `teacher` (rows: public samples)."""
        hp = self.hparams

        def loss(logits, labels, rows):
            device = logits.device
            kd = selective_kd_loss(prompt_end_rows(logits, labels, IGNORE_INDEX),
                                   teacher[rows].to(device), keep[rows].to(device),
                                   hp.kd_temperature)
            ce = answer_losses(logits, labels, IGNORE_INDEX).mean()
            return (1 - hp.kd_weight) * ce + hp.kd_weight * kd
        return self.train_on_public(key, lora, loss, seed_tags)
