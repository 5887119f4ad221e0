"""PerAda (Xie et al., CVPR 2024, "PerAda: Parameter-Efficient Federated Learning
Personalization with Generalization Guarantees"), with LoRA adapters as the adapters, after
the public code NVlabs/PerAda (optim/our.py, aggregation/distillation.py).

Client (Algorithm 1; `run_local_updates`): every client keeps a personalised adapter v_i
('personal', never sent) and a local copy of the global adapter w ('default', sent). A local
round first trains v_i for one pass on CE(v_i) + λ‖v_i − w‖² (Eq. 3; the code's
`model_dist_norm_var`: squared L2, no ½, w = the global adapter received at the round's
start), then w for one pass on CE(w) alone. Evaluation and saved models use v_i. Trained
tensors outside the adapters (LLaVA's projector) belong to the global model, as in DITTO.

Server (Eq. 4-5; `server_aggregation`, `Distillation`): the clients' w_i are averaged
(FedAvg), then, in the first `kd_rounds` rounds, distilled: the student is the averaged
global adapter, the teacher the mean of the clients' local global adapters' logits
(aggregation.distill.ensemble_logits) on unlabelled public data, the loss
KL(teacher ‖ student) at temperature T (aggregation.distill.kd_divergence), Adam at kd_lr
with a cosine schedule over `kd_steps` batches. For a language model the distilled output
is the next-token distribution at the end of each public prompt (the first answer token):
the public records' answers are never used.
Choice (the server holds no labelled data in FS-LLM): the code early-stops on a labelled
server validation set and keeps the averaged model when distillation does not improve it;
here the `kd_steps` steps always run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation.distill import ensemble_logits, kd_divergence
from fs_plugins.aggregation.signature import tensor_signature
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.public import public_records
from fs_plugins.methods.base import Phase, activate_adapters, load_tensors
from fs_plugins.methods.building import build_model
from fs_plugins.methods.ditto import GLOBAL, PERSONAL, Ditto, is_personal
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.specs import data_source, device_for
from fs_plugins.schema import option

logger = logging.getLogger(__name__)


@dataclass
class PerAdaConfig:
    lam: float = option(0.05, 'λ of λ‖v_i − w‖² pulling the personal adapter to the received '
                              'global one (Eq. 3; code default 0.05, its scripts 0.1-1)', ge=0)
    kd_rounds: int = option(30, 'rounds (from the first) whose aggregation ends with server '
                                'distillation (the code\'s kd_max_round: 30); 0: FedAvg only '
                                '("PerAda w/o KD")', ge=0)
    kd_steps: int = option(500, 'distillation batches per round (the code\'s '
                                'total_n_server_pseudo_batches; its scripts: 500)', ge=1)
    kd_batch_size: int = option(8, 'public records per distillation batch', ge=1)
    kd_lr: float = option(1e-3, 'Adam learning rate of the distillation (cosine-annealed over '
                                'kd_steps; code: 1e-3)', gt=0)
    kd_temperature: float = option(1.0, 'T of KL(softmax(t/T) ‖ softmax(s/T)) (code: 1)', gt=0)
    public_data: str = option('', 'unlabelled public data for the distillation: a .json/.jsonl '
                                  'record file, or a builtin dataset name (its train records); '
                                  "'' = the run's data (data.type). Only the prompts are used")
    public_samples: int = option(256, 'public records used (a seeded choice)', ge=2)


@register_method
class PerAda(Ditto):
    name = 'perada'
    summary = ('PerAda: personal LoRA (CE + λ‖v − w‖²) then global LoRA (CE) per round; server '
               'averages the global LoRA and distils the clients\' ensemble into it on '
               'unlabelled public prompts; evaluation uses the personal one')
    sent = 'global A, B / distilled global A, B'
    config_class = PerAdaConfig

    def __init__(self, cfg):
        super().__init__(cfg)
        # (builder, model.type) -> (BuiltModel, public batches, its updates' tensor_signature)
        self._server_models: dict = {}

    # ------------------------------------------------------------------ client
    def phases(self, num_steps, cfg):
        return [Phase('personal', num_steps, is_personal, adapters=(PERSONAL,)),
                Phase('global', num_steps, lambda n: not is_personal(n), adapters=(GLOBAL,))]

    def proximal_coefficient(self) -> float:
        return self.hparams.lam   # the code's model_dist_norm_var: no ½

    # ------------------------------------------------------------------ server
    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'rounds': 0}

    def aggregate(self, server_state, updates):
        state = super().aggregate(server_state, updates)
        rounds = server_state.get('rounds', 0)
        state['rounds'] = rounds + 1
        if rounds < self.hparams.kd_rounds:
            state['global'] = {**state['global'],
                               **self.distil(state['global'], updates, rounds)}
        return state

    def distil(self, averaged: dict, updates, round_idx: int) -> dict:
        """The averaged global adapter distilled towards the clients' ensemble (Eq. 5)."""
        built, batches = self.server_model(updates)
        model, hp = built.model, self.hparams
        device = next(model.parameters()).device
        activate_adapters(model, (GLOBAL,))
        model.eval()

        def client_logits():   # each client's adapter loaded once, all batches at a time
            for update in updates:
                load_tensors(model, update.shared)
                yield torch.cat([prompt_end_logits(model, batch, device) for batch in batches])
        with torch.no_grad():
            teacher = ensemble_logits(client_logits()).split(
                [batch['input_ids'].shape[0] for batch in batches])
        load_tensors(model, averaged)
        names = set(averaged)
        params = [p for n, p in model.named_parameters() if n in names]
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        for name, param in model.named_parameters():
            param.requires_grad_(name in names)
        optimizer = torch.optim.Adam(params, lr=hp.kd_lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, hp.kd_steps)
        model.train()
        losses = []
        # the student's dropout draws from its own seed, not from the clients' stream
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
            torch.manual_seed(derive_seed(self.cfg.seed, 'perada-kd', round_idx))
            for step in range(hp.kd_steps):
                index = step % len(batches)
                loss = kd_divergence(prompt_end_logits(model, batches[index], device),
                                     teacher[index].to(device), hp.kd_temperature)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        logger.info(f'PerAda: distilled {len(updates)} clients into the global adapter on '
                    f'{len(batches)} public batches, {hp.kd_steps} steps: KL {losses[0]:.4g} -> '
                    f'{losses[-1]:.4g}')
        return {n: p.detach().to('cpu').clone() for n, p in model.named_parameters() if n in names}

    def server_model(self, updates):
        """The model (and public batches) of the updates' architecture, built once: from the
        config of the first update's client when the runner knows it, else the run's."""
        cid = updates[0].client_id
        cfg = self.client_configs.get(cid, self.cfg)
        key = (cfg.fsplug.model.builder, str(cfg.model.type))
        if key not in self._server_models:
            built = build_model(cfg, type(self)(cfg))
            records = public_records(self.hparams.public_data, data_source(cfg),
                                     self.hparams.public_samples,
                                     derive_seed(cfg.seed, 'perada-public'), 'fsplug.perada.public_data')
            codec, size = built.codec, self.hparams.kd_batch_size
            batches = [codec.collate([codec.encode_prompt(r) for r in records[i:i + size]])
                       for i in range(0, len(records), size)]
            built.model.to(device_for(cfg))
            signature = tensor_signature(self.shared_tensors(built.model, built.trainable_names))
            self._server_models[key] = (built, batches, signature)
        built, batches, signature = self._server_models[key]
        if tensor_signature(updates[0].shared) != signature:
            raise ValueError(f"PerAda: client {cid}'s update does not fit the server's "
                             f"distillation model (model.type '{cfg.model.type}'); with clients "
                             f"on several models set fsplug.aggregation.per_architecture: True "
                             f"and give the server every client's --client_cfg")
        return built, batches


def prompt_end_logits(model, batch: dict, device) -> torch.Tensor:
    """(rows, vocab) logits at each right-padded prompt's last token: the model's
    distribution over the first answer token."""
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(**batch).logits
    last = batch['attention_mask'].sum(1) - 1
    return logits[torch.arange(logits.shape[0], device=logits.device), last]
