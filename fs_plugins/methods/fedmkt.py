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
The server's θ_s is the run's model (its model.type; the larger/pivot model when the clients'
--client_cfg gives them smaller ones) and is the run's saved global state.

Choices (the paper cannot be read here):
- Step 5 runs on the server, from the client's uploaded θ_k on a server-side copy of its
  architecture: the same public data, starting adapter and loss give the adapter the client
  would compute; what travels is each client's LoRA (up and down) instead of public-set logits.
- The distilled distribution is the next-token one at the end of each public prompt (as
  PerAda here), not every answer position (FedMKT aligns whole sequences): positions need no
  sequence alignment across tokenizers.
- The teachers' selection uses the losses measured once at the start of each direction.
- λ (kd_weight), T, the optimiser (Adam, constant kd_lr) and one pass over the public set per
  direction (kd_epochs) are this implementation's defaults.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation.fedmkt import (
    align_probabilities,
    answer_losses,
    min_edit_distance_alignment,
    prompt_end_rows,
    select_teachers,
    selective_kd_loss,
)
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.data.public import public_records
from fs_plugins.methods.base import Method, load_tensors
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.specs import data_source, device_for
from fs_plugins.schema import option
from fs_plugins.schema.options import to_plain

logger = logging.getLogger(__name__)


@dataclass
class FedMKTConfig:
    kd_weight: float = option(0.5, 'λ of (1 − λ)·CE + λ·KD in both distillation directions '
                                   '(FedMKT, Fan et al. COLING 2025: CE on the public labels plus '
                                   'the selected teacher\'s KD; λ is this implementation\'s choice)',
                              ge=0, le=1)
    kd_epochs: int = option(1, 'passes over the public set per direction and round (server '
                               'model from the clients, then each client from the server)', ge=1)
    kd_batch_size: int = option(8, 'public records per distillation batch', ge=1)
    kd_lr: float = option(1e-3, 'Adam learning rate of the distillation steps', gt=0)
    kd_temperature: float = option(1.0, 'T of KL(q ‖ softmax(z/T)), q the teacher\'s '
                                        'softmax(z_t/T) aligned to the student\'s vocabulary', gt=0)
    public_data: str = option('', 'labelled public data shared by the server and the clients '
                                  '(FedMKT\'s public set): a .json/.jsonl record file, or a builtin '
                                  "dataset name (its train records); '' = the run's data (data.type)")
    public_samples: int = option(256, 'public records used (a seeded choice)', ge=2)


@register_method
class FedMKT(Method):
    name = 'fedmkt'
    summary = ('FedMKT: clients train LoRA locally; the server distils them into its own LoRA model '
               'and back on public data (MinED token alignment, a teacher kept only where its loss '
               'is lower); each client receives its distilled LoRA')
    sent = 'A, B / the client\'s distilled A, B'
    config_class = FedMKTConfig
    robust_aggregation_refusal = 'nothing is averaged: the server distils logits between models'
    # FedMosaic Table 15: "Public data Logit Share", memory 1.002, compute 1.574 × SFT
    relative_cost = 1.574

    def __init__(self, cfg):
        super().__init__(cfg)
        self._models: dict = {}       # architecture key -> (BuiltModel, public batches)
        self._alignments: dict = {}   # (source key, target key) -> token index map

    # ------------------------------------------------------------------ server
    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'clients': {}, 'rounds': 0}

    def content_for(self, server_state, client_id):
        # before its first distillation a client keeps its own initial adapter
        return server_state['clients'].get(str(client_id), {})

    def aggregate(self, server_state, updates):
        rounds = server_state['rounds']
        server_key = self.architecture(self.cfg)
        client_keys = {u.client_id: self.architecture(self.client_configs.get(u.client_id, self.cfg))
                       for u in updates}
        client_views = {u.client_id: self.measure(client_keys[u.client_id], u.shared)
                        for u in updates}
        server_view = self.measure(server_key, server_state['global'])
        server_lora = self.server_from_clients(server_key, server_state['global'], server_view,
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
        return {**server_state, 'global': {**server_state['global'], **server_lora},
                'clients': clients, 'rounds': rounds + 1}

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

    # ------------------------------------------------------------------ models on the server
    def architecture(self, cfg) -> str:
        """The key of a participant's model: its model.type and fsplug.model node."""
        key = repr((to_plain(cfg.model.type), to_plain(cfg.fsplug.model)))
        if key not in self._models:
            built = build_model(cfg, type(self)(cfg))
            built.model.to(device_for(cfg))
            self._models[key] = (built, self.public_batches(built.codec, cfg))
        return key

    def public_batches(self, codec, cfg) -> list[dict]:
        """The labelled public records, encoded by `codec` (the same records for every model)."""
        hp = self.hparams
        records = public_records(hp.public_data, data_source(self.cfg), hp.public_samples,
                                 derive_seed(self.cfg.seed, 'fedmkt-public'),
                                 'fsplug.fedmkt.public_data')
        examples = [codec.encode(r) for r in records]
        dropped = sum(e is None for e in examples)
        if dropped:
            raise ConfigError(f'fsplug.fedmkt.public_data: {dropped} public record(s) leave no '
                              f'answer token within llm.tok_len for model {cfg.model.type}')
        size = hp.kd_batch_size
        return [codec.collate(examples[i:i + size]) for i in range(0, len(examples), size)]

    def alignment(self, source_key: str, target_key: str) -> torch.Tensor:
        """Source token id -> target token id (MinED), computed once per pair of models."""
        pair = (source_key, target_key)
        if pair not in self._alignments:
            source, target = (self._models[k][0].codec.tokenizer for k in pair)
            tokens = [tok.convert_ids_to_tokens(list(range(len(tok)))) for tok in (source, target)]
            self._alignments[pair] = (torch.arange(len(tokens[0])) if tokens[0] == tokens[1]
                                      else min_edit_distance_alignment(*tokens))
        return self._alignments[pair]

    def measure(self, key: str, lora: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample answer losses, prompt-end logits) of model `key` with `lora` on the
        public set, on the CPU in float32."""
        built, batches = self._models[key]
        model = built.model
        load_tensors(model, lora)
        model.eval()
        losses, logits = [], []
        with torch.no_grad():
            for batch in batches:
                out, labels = self.forward(model, batch)
                losses.append(answer_losses(out, labels, IGNORE_INDEX).cpu())
                logits.append(prompt_end_rows(out, labels, IGNORE_INDEX).float().cpu())
        return torch.cat(losses), torch.cat(logits)

    @staticmethod
    def forward(model, batch: dict):
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop('labels')
        return model(**batch).logits, labels

    def distil(self, key: str, lora: dict, teacher: torch.Tensor, keep: torch.Tensor,
               seed_tags: tuple) -> dict:
        """`lora` on model `key` trained for kd_epochs passes over the public set on
        (1 − λ)·CE + λ·selective KD towards `teacher` (rows: public samples)."""
        built, batches = self._models[key]
        model, hp = built.model, self.hparams
        device = next(model.parameters()).device
        load_tensors(model, lora)
        names = set(lora)
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        for name, param in model.named_parameters():
            param.requires_grad_(name in names)
        optimizer = torch.optim.Adam([p for n, p in model.named_parameters() if n in names],
                                     lr=hp.kd_lr)
        rows = [b['input_ids'].shape[0] for b in batches]
        teachers, keeps = teacher.split(rows), keep.split(rows)
        model.train()
        # the distillation's dropout draws from its own seed, not from the clients' stream
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
            torch.manual_seed(derive_seed(self.cfg.seed, *seed_tags))
            for _ in range(hp.kd_epochs):
                for batch, target, kept in zip(batches, teachers, keeps):
                    logits, labels = self.forward(model, batch)
                    kd = selective_kd_loss(prompt_end_rows(logits, labels, IGNORE_INDEX),
                                           target.to(device), kept.to(device), hp.kd_temperature)
                    ce = answer_losses(logits, labels, IGNORE_INDEX).mean()
                    loss = (1 - hp.kd_weight) * ce + hp.kd_weight * kd
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        return {n: p.detach().to('cpu').clone() for n, p in model.named_parameters() if n in names}
