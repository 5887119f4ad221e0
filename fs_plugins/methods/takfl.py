"""TAKFL (Morafah et al., NeurIPS 2024, "Towards Diverse Device Heterogeneous Federated Learning
via Task Arithmetic Knowledge Integration"), after the released code (hojinchangucsd/TAKFL,
nlp/src/benchmarks/main_fedhd.py, whose algorithm name is FedHD) and as FedMosaic runs it (§5,
A.6: a federated distillation baseline sharing knowledge between heterogeneous models via
logits on public data; Table 15: no extra communication, compute 1.294 × SFT).

A device prototype is a model architecture (model.type with fsplug.model): clients of one
prototype share it. Every model carries LoRA. A round:
1. Each client k trains its LoRA θ_k on its private data and uploads it.
2. Within each prototype i the server averages its clients' LoRA (FedAvg, weights p_k):
   θ_avg,i (§4.1).
3. On the public set (each model tokenising the same records with its own tokenizer), each
   prototype j's teacher is the average of its clients' logits (the code's avg_logits_list);
   the self-teacher of prototype i is θ_avg,i's own logits.
4. For each student prototype i and each teacher prototype j (j = i included), θ_avg,i is
   distilled separately: T²·KL(q_j ‖ softmax(z/T)) + γ·T_s²·KL(softmax(z_avg,i/T_s) ‖
   softmax(z/T_s)) (§4.2's self-regularisation), q_j carried to i's vocabulary by MinED token
   alignment where the vocabularies differ (aggregation.fedmkt.align_probabilities). The task
   vector is τ_ij = θ_ij − θ_avg,i.
5. Task arithmetic (§4.3): θ_i = θ_avg,i + Σ_j λ_ij τ_ij, with λ given (the code's
   `no_tuning`) or searched among the code's heuristic candidates (`heuristic`, the setting of
   its NLP script, our default). Every client of prototype i receives θ_i.
The run's own model's θ_i is the saved global state.

Choices (ours, where the paper and code are silent or do not fit LLMs):
- The distilled distribution is the next-token one at the end of each public prompt (as
  FedMKT and PerAda here): positions need no sequence alignment across tokenizers.
- The heuristic search scores a candidate by the merged model's answer-token accuracy on the
  (labelled) public records (search_metric; 'loss': its mean answer loss); the code scores
  accuracy on a labelled validation split of the private data, which the server here does not
  hold. 25 candidates per exponent, the code's heuristic function's default.
- FedMosaic's authors ran TAKFL with self-regularisation γ = 0.01 and uniform merge weights
  (coefficients 'given', task_weights []): the FedMosaic tables' TAKFL rows set that.
- Teachers are ordered from the smallest prototype (total parameter count of its model) up,
  the order of the code's prototypes and of its sorted candidates.
- The code's `backprop` tuning of λ (on the test set) is not offered.
- Optimiser: Adam at the training rate (kd_lr 0) or kd_lr, constant, no weight decay (the NLP
  script's distill_wd 0).
- Server-side copies of each prototype's model, the public batches, the token alignment, the
  measuring pass and the distillation's optimisation loop are shared with FedMKT
  (methods/server_models.py).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch

from fs_plugins.aggregation import ensemble_logits, weighted_average
from fs_plugins.aggregation.fedmkt import align_probabilities, prompt_end_rows
from fs_plugins.aggregation.takfl import (
    candidate_coefficients,
    group_by_prototype,
    merge_task_vectors,
    takfl_distillation_loss,
    task_vectors,
)
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.methods.base import weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.server_models import BatchLoss, ServerModels, architecture_key
from fs_plugins.schema import option

logger = logging.getLogger(__name__)

COEFFICIENT_MODES = ('search', 'given')


@dataclass
class TAKFLConfig:
    coefficients: str = option('search', "how the merging coefficients λ of θ_avg + Σ_j λ_j τ_j "
                                         "are set (TAKFL §4.3): 'search' = the released code's "
                                         "heuristic (its --tune_lambda heuristic, used by its NLP "
                                         "script): the candidate with the lowest public answer "
                                         "loss; 'given' = task_weights (--tune_lambda no_tuning)",
                               choices=COEFFICIENT_MODES)
    task_weights: list[float] = option([], "'given': one λ per teacher prototype, from the "
                                           'smallest model up (the code\'s --task_weights row); '
                                           '[] = uniform 1/J', ge=0)
    search_candidates: int = option(25, "'search': random candidates per exponent (1, 5, 10) "
                                        "besides the uniform one (the released code's heuristic "
                                        "function's default 25; its CLI passes 10)", ge=1)
    search_metric: str = option('accuracy', "'search': what scores a merged candidate on the "
                                            "labelled public set: 'accuracy' (its answer-token "
                                            "accuracy, as the code scores validation accuracy) or "
                                            "'loss' (its mean answer loss, the lowest wins)",
                                choices=('accuracy', 'loss'))
    self_weight: float = option(0.5, "γ of TAKFL's self-regularisation towards the prototype's "
                                     "own averaged model (§4.2; the code's --self_reg default "
                                     '0.5)', ge=0)
    self_temperature: float = option(20.0, 'T_s of the self-regularisation KL (the code\'s '
                                           'T_self = 20)', gt=0)
    kd_temperature: float = option(3.0, 'T of the distillation KL, scaled by T² (the code\'s '
                                        '--distill_T of its NLP script)', gt=0)
    kd_epochs: int = option(1, "passes over the public set per (student, teacher) distillation "
                               "(the code's --distill_E of its NLP script)", ge=1)
    kd_batch_size: int = option(8, 'public records per distillation batch', ge=1)
    kd_lr: float = option(0.0, 'Adam learning rate of the distillation steps; 0 = the training '
                               'rate (train.optimizer.lr; the code distils at its fine-tuning '
                               'rate, 3e-5 for whole models)', ge=0)
    public_data: str = option('held_out', "public data the server distils on (TAKFL's "
                                          "unlabelled public set; its labels serve only the "
                                          "'search'): a .json/.jsonl record file, a builtin "
                                          "dataset name (its train records), 'held_out' "
                                          "(public_samples training records of the run's data "
                                          'held apart from every client: fsplug.data.'
                                          "public_holdout) or 'clients' (the clients' own "
                                          'training records, explicitly)')
    public_samples: int = option(256, 'public records used (a seeded choice)', ge=2)


@register_method
class TAKFL(ServerModels):
    name = 'takfl'
    summary = ('TAKFL: clients of one model architecture (device prototype) are averaged; the '
               'server distils each prototype separately from every prototype\'s averaged '
               'logits on public data (self-regularised) and merges the task vectors by task '
               'arithmetic; each client receives its prototype\'s merged LoRA')
    sent = "A, B / its prototype's merged A, B"
    config_class = TAKFLConfig
    robust_aggregation_refusal = ('prototypes are merged by distillation and task arithmetic, '
                                  'not by an average of every upload')
    # FedMosaic Table 15: no extra communication, memory 1.000, compute 1.294 × SFT
    relative_cost = 1.294
    paper_relative_cost = 1.294

    # ------------------------------------------------------------------ server
    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'prototypes': {}, 'rounds': 0}

    def content_for(self, server_state, client_id):
        # before its prototype's first merge a client keeps its own initial adapter
        cfg = self.client_configs.get(client_id, self.cfg)
        return server_state['prototypes'].get(prototype_label(cfg), {})

    def aggregate(self, server_state, updates):
        rounds = server_state['rounds']
        configs = {u.client_id: self.client_configs.get(u.client_id, self.cfg) for u in updates}
        groups = group_by_prototype({cid: self.architecture(cfg) for cid, cfg in configs.items()})
        keys = sorted(groups, key=lambda k: (self.model_size(k), k))
        by_client = {u.client_id: u for u in updates}
        averaged, teachers = {}, {}
        for key in keys:
            members = [by_client[cid] for cid in groups[key]]
            averaged[key] = weighted_average([u.shared for u in members], weights_of(members))
            teachers[key] = ensemble_logits(self.measure(key, u.shared)[1] for u in members)
        labels = {key: prototype_label(configs[groups[key][0]]) for key in keys}
        prototypes = dict(server_state['prototypes'])
        for key in keys:
            prototypes[labels[key]] = self.merged_prototype(key, averaged[key], teachers, labels,
                                                            rounds)
        own = prototypes.get(prototype_label(self.cfg), {})
        return {**server_state, 'global': {**server_state['global'], **own},
                'prototypes': prototypes, 'rounds': rounds + 1}

    def merged_prototype(self, key: str, averaged: dict, teachers: dict, labels: dict,
                         round_idx: int) -> dict:
        """θ_avg + Σ_j λ_j τ_j of student prototype `key`: one distillation per teacher
        (teachers: {prototype key: its clients' averaged public logits}, smallest first)."""
        hp = self.hparams
        _, self_logits = self.measure(key, averaged)
        self_probs = torch.softmax(self_logits / hp.self_temperature, -1)
        vocab = self_logits.shape[-1]
        distilled = []
        for teacher_key, logits in teachers.items():
            teacher = align_probabilities(torch.softmax(logits / hp.kd_temperature, -1),
                                          self.alignment(teacher_key, key), vocab)
            distilled.append(self.train_on_public(
                key, averaged, self.distillation_loss(teacher, self_probs),
                ('takfl-kd', round_idx, labels[key], labels[teacher_key])))
        vectors = task_vectors(distilled, averaged)
        coefficients = self.coefficients_for(key, averaged, vectors, labels[key], round_idx)
        logger.info(f'TAKFL: prototype {labels[key]} merged with λ = '
                    f'{[round(c, 4) for c in coefficients]}')
        return merge_task_vectors(averaged, vectors, coefficients)

    def coefficients_for(self, key: str, averaged: dict, vectors: list, label: str,
                         round_idx: int) -> list[float]:
        """λ of the merge: task_weights ('given'), or the heuristic candidate whose merged
        model scores best on the labelled public set ('search', search_metric; ties to the
        earlier one)."""
        hp, count = self.hparams, len(vectors)
        if hp.coefficients == 'given':
            if not hp.task_weights:
                return [1.0 / count] * count
            if len(hp.task_weights) != count:
                raise ConfigError(f'fsplug.takfl.task_weights: {len(hp.task_weights)} value(s) '
                                  f'for {count} teacher prototype(s) this round')
            return list(hp.task_weights)
        rng = np.random.default_rng(derive_seed(self.cfg.seed, 'takfl-search', round_idx, label))
        candidates = candidate_coefficients(count, hp.search_candidates, rng)
        def score(merged: dict) -> float:   # higher is better
            if hp.search_metric == 'loss':
                return -float(self.measure(key, merged)[0].mean())
            return self.public_accuracy(key, merged)
        scores = [score(merge_task_vectors(averaged, vectors, c)) for c in candidates]
        return candidates[scores.index(max(scores))]

    # ------------------------------------------------------------------ distillation
    def distillation_loss(self, teacher: torch.Tensor, self_probs: torch.Tensor) -> BatchLoss:
        """TAKFL's per-batch loss towards `teacher` with the self-regulariser `self_probs`
        (rows of both: public samples)."""
        hp = self.hparams

        def loss(logits, labels, rows):
            device = logits.device
            return takfl_distillation_loss(
                prompt_end_rows(logits, labels, IGNORE_INDEX), teacher[rows].to(device),
                self_probs[rows].to(device), hp.kd_temperature, hp.self_temperature,
                hp.self_weight)
        return loss


def prototype_label(cfg) -> str:
    """A participant's device prototype as a short name (a digest of its architecture_key, the
    key the server's model copies are kept under): a server state key."""
    return 'prototype-' + hashlib.sha1(architecture_key(cfg).encode()).hexdigest()[:12]
