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

Clients on different models (--client_cfg; FedMosaic A.6: "Federated distillation baselines
(i.e., TAKFL, PerAda, and FedMKT) share knowledge between heterogeneous models via logits",
and its Tables 4 and 19 run PerAda across Llama and Qwen LLaVAs): with
fsplug.aggregation.per_architecture False (the default) the server groups the updates by
architecture (the names and shapes of their tensors), averages each group's global adapters
(parameters are only averaged within an architecture), and distils every group's average
towards ONE teacher: the mean of all clients' prompt-end logits, each client's computed with
its own architecture's model on the same public prompts (each tokenised by its own
tokenizer). Logits are compared over the vocabulary the clients' tokenizers share: the whole
vocabulary when they are the same, else the tokens spelled the same in every tokenizer
(choice: the papers do not say how vocabularies are matched). A client receives its
architecture's global adapter (before its architecture has reported: its own initial one).
With per_architecture True the server's groups aggregate apart (Fed-ET-style): each group's
distillation only sees its own clients.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.distill import ensemble_logits, kd_divergence
from fs_plugins.aggregation.signature import tensor_signature
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.public import public_records
from fs_plugins.methods.base import Phase, activate_adapters, load_tensors, weights_of
from fs_plugins.methods.building import build_model
from fs_plugins.methods.ditto import GLOBAL, PERSONAL, Ditto, is_personal
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.specs import data_source, device_for, split_spec
from fs_plugins.schema import option
from fs_plugins.schema.options import to_plain

logger = logging.getLogger(__name__)

OWN = 'run'   # the group of the run's own architecture (its global adapter is state['global'])


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
    public_data: str = option('held_out', 'unlabelled public data for the distillation: a '
                                          '.json/.jsonl record file, a builtin dataset name (its '
                                          "train records), 'held_out' (public_samples training "
                                          "records of the run's data held apart from every "
                                          "client: fsplug.data.public_holdout) or 'clients' (the "
                                          "clients' own training records, explicitly). Only the "
                                          'prompts are used')
    public_samples: int = option(256, 'public records used (a seeded choice)', ge=2)


@register_method
class PerAda(Ditto):
    name = 'perada'
    robust_aggregation_refusal = "its server distils the global adapters from every client's adapters"
    summary = ('PerAda: personal LoRA (CE + λ‖v − w‖²) then global LoRA (CE) per round; server '
               'averages the global LoRA and distils the clients\' ensemble into it on '
               'unlabelled public prompts; evaluation uses the personal one')
    sent = 'global A, B / distilled global A, B'
    config_class = PerAdaConfig
    # FedMosaic Table 15: "Double Forward/Backward & Logit Extraction", 2.294 × SFT (the
    # paper charges the distillation's logit extraction to the method; here it runs on the server)
    relative_cost = 2.294
    paper_relative_cost = 2.294

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
        groups = self.architecture_groups(server_state, updates)
        if set(groups) != {OWN} or server_state.get('globals'):
            return self.aggregate_across(server_state, groups)
        state = super().aggregate(server_state, updates)
        rounds = server_state.get('rounds', 0)
        state['rounds'] = rounds + 1
        if rounds < self.hparams.kd_rounds:
            state['global'] = {**state['global'],
                               **self.distil(state['global'], updates, rounds)}
        return state

    def architecture_groups(self, server_state, updates) -> dict[str, list]:
        """The updates by architecture: OWN for the run's model (the signature of
        state['global']), else a key made from their tensors' names and shapes."""
        own = tensor_signature(server_state.get('global', {}))
        groups: dict[str, list] = {}
        for update in updates:
            signature = tensor_signature(update.shared)
            key = OWN if signature == own else hashlib.sha256(
                repr(signature).encode()).hexdigest()[:12]
            groups.setdefault(key, []).append(update)
        return groups

    def aggregate_across(self, server_state, groups: dict[str, list]) -> dict:
        """Clients on several architectures: each group's global adapters averaged, then all
        groups distilled towards the ensemble of every client's logits."""
        rounds = server_state.get('rounds', 0)
        previous = {OWN: server_state['global'], **server_state.get('globals', {})}
        averaged = {key: {**previous.get(key, {}),
                          **weighted_average([u.shared for u in members], weights_of(members))}
                    for key, members in groups.items()}
        if rounds < self.hparams.kd_rounds:
            averaged = {**averaged, **self.distil_across(averaged, groups, rounds)}
        client_group = dict(server_state.get('client_group', {}))
        client_group.update({str(u.client_id): key for key, members in groups.items()
                             for u in members})
        own = averaged.pop(OWN, server_state['global'])
        return {**server_state, 'global': own, 'rounds': rounds + 1,
                'globals': {**server_state.get('globals', {}), **averaged},
                'client_group': client_group}

    def content_for(self, server_state, client_id):
        key = server_state.get('client_group', {}).get(str(client_id))
        if key is not None:
            return server_state['global'] if key == OWN else server_state['globals'][key]
        if self.cfg.fsplug.aggregation.per_architecture or self.runs_the_runs_model(client_id):
            return server_state['global']
        return {}   # another architecture, not reported yet: it keeps its initial adapters

    def runs_the_runs_model(self, client_id) -> bool:
        """Whether client `client_id`'s config (when the server has it) builds the run's model."""
        cfg = self.client_configs.get(client_id)
        return cfg is None or all(
            to_plain(cfg[a][b]) == to_plain(self.cfg[a][b]) for a, b in (('model', 'type'),
                                                                          ('fsplug', 'model')))

    def distil_across(self, averaged: dict, groups: dict[str, list], round_idx: int) -> dict:
        """Each group's averaged global adapter distilled towards one teacher: the mean of all
        clients' logits over the tokenizers' shared vocabulary."""
        models = {key: self.server_model(members) for key, members in groups.items()}
        rows = {key: [b['input_ids'].shape[0] for b in batches]
                for key, (_, batches) in models.items()}
        if len({tuple(r) for r in rows.values()}) > 1:
            raise ValueError('PerAda: the architectures\' public batches differ '
                             f'({rows}); the distillation needs the same public records')
        index = shared_vocabulary({key: built.codec.tokenizer for key, (built, _) in models.items()},
                                  groups)
        teacher = self.teacher_logits([(models[key], index[key], members)
                                       for key, members in groups.items()])
        return {key: self.train_student(built, batches, averaged[key], teacher, round_idx,
                                        index[key], key)
                for key, (built, batches) in models.items()}

    def teacher_logits(self, parts) -> tuple:
        """The ensemble teacher, split per public batch: the mean of every client's prompt-end
        logits; `parts`: ((built model, its batches), vocabulary index or None, updates)."""
        def client_logits():   # each client's adapter loaded once, all batches at a time
            for (built, batches), index, updates in parts:
                model = built.model
                device = next(model.parameters()).device
                activate_adapters(model, (GLOBAL,))
                model.eval()
                for update in updates:
                    load_tensors(model, update.shared)
                    logits = torch.cat([prompt_end_logits(model, batch, device)
                                        for batch in batches])
                    yield logits if index is None else logits[:, index.to(logits.device)].cpu()
        with torch.no_grad():
            return ensemble_logits(client_logits()).split(
                [batch['input_ids'].shape[0] for batch in parts[0][0][1]])

    def distil(self, averaged: dict, updates, round_idx: int) -> dict:
        """The averaged global adapter distilled towards the clients' ensemble (Eq. 5)."""
        built, batches = self.server_model(updates)
        teacher = self.teacher_logits([((built, batches), None, updates)])
        return self.train_student(built, batches, averaged, teacher, round_idx)

    def train_student(self, built, batches, averaged: dict, teacher, round_idx: int,
                      index: torch.Tensor | None = None, group: str = OWN) -> dict:
        """`averaged` (a global adapter of `built`'s architecture) trained for kd_steps on
        KL(teacher ‖ student), the student's logits taken at `index` (None: all)."""
        model, hp = built.model, self.hparams
        device = next(model.parameters()).device
        index = None if index is None else index.to(device)
        activate_adapters(model, (GLOBAL,))
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
        tags = ('perada-kd', round_idx) if group == OWN else ('perada-kd', round_idx, group)
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
            torch.manual_seed(derive_seed(self.cfg.seed, *tags))
            for step in range(hp.kd_steps):
                which = step % len(batches)
                student = prompt_end_logits(model, batches[which], device)
                if index is not None:
                    student = student[:, index]
                loss = kd_divergence(student, teacher[which].to(device), hp.kd_temperature)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
        for name, param in model.named_parameters():
            param.requires_grad_(flags[name])
        logger.info(f'PerAda: distilled the clients\' ensemble into the global adapter ({group}) on '
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
            # the run's records for every architecture: one teacher row per public record
            records = public_records(self.hparams.public_data, data_source(self.cfg),
                                     self.hparams.public_samples,
                                     derive_seed(self.cfg.seed, 'perada-public'),
                                     'fsplug.perada.public_data', split_spec(self.cfg))
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
                             f"on several models give the server every client's --client_cfg "
                             f"(it builds each architecture's model)")
        return built, batches


def prompt_end_logits(model, batch: dict, device) -> torch.Tensor:
    """(rows, vocab) logits at each right-padded prompt's last token: the model's
    distribution over the first answer token."""
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(**batch).logits
    last = batch['attention_mask'].sum(1) - 1
    return logits[torch.arange(logits.shape[0], device=logits.device), last]


def shared_vocabulary(tokenizers: dict, groups: dict) -> dict:
    """{group: index of the shared vocabulary's tokens in its logits, or None when every
    tokenizer has the same vocabulary}: the tokens spelled the same in all of them, in order."""
    vocabularies = {key: tok.get_vocab() for key, tok in tokenizers.items()}
    first = next(iter(vocabularies.values()))
    if all(v == first for v in vocabularies.values()):
        return dict.fromkeys(vocabularies)
    shared = sorted(set.intersection(*(set(v) for v in vocabularies.values())))
    if not shared:
        clients = {key: [u.client_id for u in members] for key, members in groups.items()}
        raise ValueError(f"PerAda: the clients' tokenizers share no token (clients by "
                         f"architecture: {clients}); the distillation compares logits over "
                         f"a shared vocabulary")
    logger.info(f'PerAda: distilling over the {len(shared)} tokens the clients\' '
                f'{len(vocabularies)} tokenizers share')
    return {key: torch.tensor([v[token] for token in shared]) for key, v in vocabularies.items()}
