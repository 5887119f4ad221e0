"""One client's side of a round, shared by the FS trainer and the embedded runner.

The FS trainer calls the step-level pieces from its hooks (`begin_round`, `next_batch`,
`compute_loss`, `optimise`, `record`, `end_round`); the embedded runner calls `run_round`,
which is the same sequence. The client's model, its persistent `state` and its batch stream
live here, so client-local parameters and counters survive across rounds in both runners.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from fs_plugins.core.seeding import derive_seed, use_deterministic_algorithms
from fs_plugins.data import stream
from fs_plugins.data.batches import BatchStream, eval_batches, local_steps
from fs_plugins.data.federated import nothing_fits_error
from fs_plugins.data.multimodal import reference_answer
from fs_plugins.methods.base import ClientUpdate, Method, Phase, activate_adapters
from fs_plugins.metrics.generation_metrics import GENERATION_METRICS, configure_generation_metrics
from fs_plugins.models.builders import BuiltModel
from fs_plugins.models.codecs import EncodedDataset
from fs_plugins.models.precision import DTYPES, forward_context, grad_scaler, place_model
from fs_plugins.run.artifacts import client_dir, save_client_model
from fs_plugins.run.flops import StepCounter, measured_relative_cost, phase_key
from fs_plugins.run.optim import build_optimizer, build_scheduler, schedule_window
from fs_plugins.run.privacy import nbafl_settings, private_upload, upload_sigma

logger = logging.getLogger(__name__)

EVAL_SPLITS = ('test', 'val', 'others')


def expand_phases(phases: list[Phase]) -> list[Phase]:
    """Phase of each local step of a round."""
    if not phases or any(p.steps < 0 for p in phases) or sum(p.steps for p in phases) == 0:
        raise ValueError(f"Phases {[(p.name, p.steps) for p in phases]} cover no local step")
    return [p for p in phases for _ in range(p.steps)]


def matched_phases(phases: list[Phase], relative_cost: float) -> list[Phase]:
    """fsplug.train.local_compute 'matched': the phases of a round whose compute is SFT's. The
    method's steps (every phase at train.local_update_steps S: Σ steps) divided by its
    relative cost (its round's FLOPs over SFT's) give the round's steps,
    max(1, round(Σ steps / relative_cost)), apportioned to the phases in their proportions
    (largest remainder, ties to the earlier phase). DITTO (2 phases of S, cost 2): S steps in
    all, S/2 per phase."""
    if not relative_cost > 0:
        raise ValueError(f'relative cost {relative_cost}: must be > 0 '
                         f'(fsplug.train.relative_cost)')
    planned = sum(p.steps for p in phases)
    target = max(1, math.floor(planned / relative_cost + 0.5))
    quotas = [p.steps * target / planned for p in phases]
    steps = [math.floor(q) for q in quotas]
    for i in sorted(range(len(phases)), key=lambda i: (steps[i] - quotas[i], i))[:target - sum(steps)]:
        steps[i] += 1
    return [dataclasses.replace(p, steps=n) for p, n in zip(phases, steps)]


class ClientProcedure:
    def __init__(self, client_id: int, cfg, method: Method, built: BuiltModel,
                 records: dict, device='cpu'):
        self.client_id, self.cfg, self.method = client_id, cfg, method
        use_deterministic_algorithms(bool(cfg.fsplug.train.deterministic))
        method.client_id = client_id
        self.model, self.codec = built.model, built.codec
        self.trainable_names = list(built.trainable_names)
        self.params = dict(self.model.named_parameters())
        self.device = torch.device(device)
        self.dynamic = bool(cfg.fsplug.data.dynamic)
        train = records['train']
        if self.dynamic:   # the episodic memory fills in task order
            train = sorted(train, key=lambda r: r[stream.TASK_RANK])
        self.train_data = EncodedDataset(train, self.codec, f'client {client_id} train')
        # held-out splits evaluated as <split>_* metrics: 'test' always, 'val' when the data has
        # one, 'others' (other clients' test records) with fsplug.data.evaluate_others
        self.eval_data = {split: EncodedDataset(records.get(split) or [], self.codec,
                                                f'client {client_id} {split}')
                          for split in EVAL_SPLITS}
        if not self.train_data:   # the split gave it records: none fits llm.tok_len
            raise nothing_fits_error(client_id, records['train'], int(cfg.llm.tok_len))
        self.collate = self.codec.collate
        self.predictions_path = None   # where evaluate() writes generated answers, if set
        self.batch_size = cfg.dataloader.batch_size
        self.accumulation = int(cfg.grad.grad_accum_count)   # micro-batches per optimiser step
        self.dtype = DTYPES[cfg.fsplug.model.dtype]
        stream_class = stream.MemoryStream if self.dynamic else BatchStream
        self.stream = stream_class(self.train_data, self.collate, self.batch_size, cfg.seed,
                                   client_id)
        self.state = method.init_client_state(self.model, cfg)
        self.optimizer = self.scheduler = None
        self.round_idx = 0   # the federation's round (0-based), for run-level LR schedules
        self.measured_cost: float | None = None   # measured once, when 'matched' needs it
        self.flop_counter = StepCounter()
        self.step_phases: list[Phase] = []
        self.phase_flops: dict[tuple, int] = {}

    # ------------------------------------------------------------------ receive
    def receive(self, content: dict) -> None:
        self.method.receive(self.model, content, self.state)

    # --------------------------------------------------------------- local round
    def steps_per_round(self) -> int:
        """One local pass as FS's train.local_update_steps / batch_or_epoch define it (a method
        may run several, one per phase)."""
        return local_steps(self.cfg.train, len(self.train_data), self.batch_size)

    def memory_size(self, round_idx: int) -> int:
        """PFL-Dynamic: training records in the episodic memory during round `round_idx`."""
        ranks = [r[stream.TASK_RANK] for r in self.train_data.records]
        counts = [ranks.count(rank) for rank in range(max(ranks) + 1)]
        return stream.revealed(counts, round_idx, int(self.cfg.federate.total_round_num))

    def begin_round(self) -> int:
        """Prepares a local round; returns its micro-batches: optimiser steps (all phases
        together) × grad.grad_accum_count."""
        # LoRA dropout (and any other draw during training) uses torch's global generator:
        # seeded per client and round, so it depends on neither the clients' order nor the runner
        torch.manual_seed(derive_seed(self.cfg.seed, 'local_round', self.client_id, self.round_idx))
        if self.dynamic:
            self.stream.set_memory(self.memory_size(self.round_idx))
        self.method.round_idx = self.round_idx
        place_model(self.model, self.device)
        phases = self.method.phases(self.steps_per_round(), self.cfg)
        if self.cfg.fsplug.train.local_compute == 'matched':
            phases = matched_phases(phases, self.relative_cost())
        self.step_phases = expand_phases(phases)
        steps = len(self.step_phases)
        self.flop_counter.stop()
        self.phase_flops = {}   # FLOPs of the round's first step of each phase
        self.model.train()
        self.optimizer = build_optimizer(self._param_groups(), self.cfg.train.optimizer)
        total, start = schedule_window(self.cfg.fsplug.train.lr_schedule, self.round_idx,
                                       int(self.cfg.federate.total_round_num), steps)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.train.scheduler, total, start)
        self.scaler = grad_scaler(self.device, self.dtype)
        self.step_index, self.current_phase = 0, None
        self.pending: list[tuple[dict, float]] = []   # the open step's micro-batches to come
        self.stats = {'loss_sum': 0.0, 'samples': 0, 'steps': 0, 'skipped': 0}
        return steps * self.accumulation

    def relative_cost(self) -> float | None:
        """The method's round FLOPs over SFT's: fsplug.train.relative_cost when set, else the
        method's declared one (FedMosaic Table 15), else, under 'matched', measured once
        (fs_plugins.run.flops); None under 'equal_steps' without either."""
        configured = float(self.cfg.fsplug.train.relative_cost)
        if configured > 0:
            return configured
        if self.method.relative_cost is not None:
            return float(self.method.relative_cost)
        if self.cfg.fsplug.train.local_compute != 'matched':
            return None
        if self.measured_cost is None:
            self.measured_cost = measured_relative_cost(self)
        return self.measured_cost

    def round_flops(self) -> int:
        """FLOPs of the round's local training: each phase's first step, counted as it ran,
        times that phase's steps (its other steps' batches may differ in length)."""
        return sum(self.phase_flops.get(phase_key(p), 0) for p in self.step_phases)

    def _param_groups(self) -> list[dict]:
        """One optimiser group per learning rate: train.optimizer.lr, and each rate the
        method sets for some parameters (Method.learning_rates)."""
        special = self.method.learning_rates(self.model, self.trainable_names)
        groups: dict = {}
        for name in self.trainable_names:
            groups.setdefault(special.get(name), []).append(self.params[name])
        return [{'params': params} if lr is None else {'params': params, 'lr': lr}
                for lr, params in groups.items()]

    def _enter_phase(self, phase: Phase) -> None:
        if phase.adapters:
            activate_adapters(self.model, phase.adapters)
        for name in self.trainable_names:
            self.params[name].requires_grad_(phase.trainable is None or phase.trainable(name))
        self.current_phase = phase

    def next_batch(self) -> dict:
        """The next micro-batch. The first of an optimiser step draws all of the step's
        micro-batches, so that each can be weighted by its share of the step's loss terms."""
        if not self.pending:
            phase = self.step_phases[min(self.step_index, len(self.step_phases) - 1)]
            if phase is not self.current_phase:
                self._enter_phase(phase)
            self.pending = micro_batch_weights([self.stream.next() for _ in range(self.accumulation)],
                                               self.codec.loss_units)
            self.step_finite = False
            if phase_key(phase) not in self.phase_flops:   # counted until the step ends
                self.phase_flops[phase_key(phase)] = 0
                self.flop_counter.start()
        batch, self.micro_weight = self.pending.pop(0)
        self.method.micro_index = self.accumulation - len(self.pending) - 1
        return {k: v.to(self.device) for k, v in batch.items()}

    def compute_loss(self, batch: dict) -> torch.Tensor:
        with forward_context(self.device, self.dtype):
            return self.method.loss(self.model, batch, self.state)

    def optimise(self, loss: torch.Tensor) -> bool:
        """Backward of one micro-batch, its loss weighted so that the step's gradient is that
        of all its micro-batches as one batch; after the step's last micro-batch, one optimiser
        step. A non-finite loss is left out (as FS-LLM skips its batch); a step with no finite
        micro-batch is skipped whole. Returns whether this micro-batch's loss was finite."""
        finite = bool(torch.isfinite(loss))
        if not finite:
            logger.warning(f"Client {self.client_id}: non-finite loss, micro-batch skipped")
        if self.method.micro_index == 0 and not self.method.gradient_free:
            self.optimizer.zero_grad(set_to_none=True)  # frozen phases keep grad None: no update
        if finite and not self.method.gradient_free:
            self.scaler.scale(loss * self.micro_weight).backward()
        self.step_finite |= finite
        if not self.pending:
            self._end_step()
        return finite

    def _end_step(self) -> None:
        if self.flop_counter.running:
            key = phase_key(self.step_phases[min(self.step_index, len(self.step_phases) - 1)])
            self.phase_flops[key] = self.flop_counter.stop()
        self.step_index += 1
        self.stats['steps'] += 1
        if not self.step_finite:
            self.stats['skipped'] += 1
            return
        if not self.method.gradient_free:
            self.scaler.unscale_(self.optimizer)
            self.method.before_optimizer_step(self.model, self.state)
            clip = self.cfg.grad.grad_clip
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([self.params[n] for n in self.trainable_names], clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scheduler is not None:
                self.scheduler.step()
        self.method.after_step(self.model, self.state)

    def record(self, loss_value: float, batch_size: int) -> None:
        if math.isfinite(loss_value):
            self.stats['loss_sum'] += loss_value * batch_size
            self.stats['samples'] += batch_size

    def end_round(self) -> ClientUpdate:
        self.flop_counter.stop()   # a step left open (a runner that stopped mid-step)
        if self.method.inference_adapters:
            activate_adapters(self.model, self.method.inference_adapters)
        for name in self.trainable_names:
            self.params[name].requires_grad_(True)
        self.optimizer = self.scheduler = None
        samples = self.stats['samples']
        shared = self.method.shared_tensors(self.model, self.trainable_names)
        extra = self.method.client_extra(self.model, self.state)
        metrics = {'train_avg_loss': self.stats['loss_sum'] / samples if samples else float('nan'),
                   'train_steps': self.stats['steps'],
                   # the round's compute (fsplug.train.local_compute): optimiser steps planned,
                   # FLOPs (fs_plugins.run.flops), the relative cost to SFT used or declared
                   'local_steps': len(self.step_phases), 'local_flops': self.round_flops(),
                   **self.method.client_metrics(self.model, self.state)}
        cost = self.relative_cost()
        if cost is not None:
            metrics['relative_cost'] = cost
        nbafl = nbafl_settings(self.cfg)
        if nbafl is not None:   # NbAFL clips and noises the upload only, not the client's model
            shared = private_upload(shared, nbafl, len(self.train_data), int(self.cfg.seed),
                                    self.client_id, self.round_idx)
            metrics['nbafl_sigma_u'] = upload_sigma(nbafl, len(self.train_data))
        return ClientUpdate(self.client_id, samples, shared, extra, metrics,
                            dataset_size=len(self.train_data))

    def run_round(self, round_idx: int) -> ClientUpdate:
        self.round_idx = round_idx
        for _ in range(self.begin_round()):
            batch = self.next_batch()
            loss = self.compute_loss(batch)
            self.optimise(loss)
            self.record(loss.item(), batch['input_ids'].shape[0])
        return self.end_round()

    # ----------------------------------------------------------------- artifacts
    def save_model(self, run_dir: str, round_idx: int) -> int:
        """Writes this client's model as it stands (fs_plugins.run.artifacts) under
        `run_dir`/adapters/client_<id>/; returns the bytes written."""
        return save_client_model(client_dir(run_dir, self.client_id), self.client_id, round_idx,
                                 self.cfg, self.method, self.model, self.trainable_names,
                                 self.state)

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, split: str = 'test') -> dict:
        """Answer-token loss and next-token accuracy (a classifier: loss and accuracy over
        its classes, `token_metrics`) on the client's own split, plus the generation metrics
        (fsplug.eval.gen_metrics) when fsplug.eval.generate is on."""
        dataset = self.eval_data.get(split)
        if dataset and self.dynamic:   # the tasks started by round_idx (own or their owners')
            total = int(self.cfg.federate.total_round_num)
            dataset = dataset.subset(lambda r: stream.visible(r, self.round_idx, total))
        if not dataset:
            return {}
        place_model(self.model, self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with forward_context(self.device, self.dtype):
                results = self._token_metrics(dataset, split)
                if self.cfg.fsplug.eval.generate:
                    results.update(self._generation_metrics(dataset, split))
        finally:
            self.model.train(was_training)
        return results

    def _eval_batch_size(self) -> int:
        return self.cfg.fsplug.eval.batch_size or self.batch_size

    def _token_metrics(self, dataset, split: str) -> dict:
        return token_metrics(self.model, dataset, self.collate, self._eval_batch_size(), split,
                             self.device, groups=modality_groups(dataset))

    def _generation_metrics(self, dataset, split: str) -> dict:
        path = self.predictions_path if split == 'test' else None
        return generation_metrics(self.model, self.codec, dataset.records, self.cfg.fsplug.eval,
                                  self._eval_batch_size(), split, self.device,
                                  predictions=(path, self.client_id) if path else None,
                                  groups=modality_groups(dataset))


def micro_batch_weights(batches: list[dict], loss_units) -> list[tuple[dict, float]]:
    """(micro-batch, weight) pairs of one optimiser step: each mean loss weighted by its share
    of the step's loss terms (`loss_units`), so Σ weight·loss is the mean over all of them."""
    units = [loss_units(batch) for batch in batches]
    total = sum(units)
    if not total:
        return [(batch, 1.0 / len(batches)) for batch in batches]
    return [(batch, count / total) for batch, count in zip(batches, units)]


def modality_groups(dataset) -> dict[str, list[int]]:
    """{label: record indices} of an evaluation set whose records have different input
    modalities ('image', 'audio', 'image+audio': the modalities each record feeds the model,
    as its codec reads them), so each is also scored apart (UniFLoW's Tables 1-3 test every
    modality separately), whenever the model has encoders of several modalities or the set
    mixes kinds; {} for a codec without media."""
    read = getattr(dataset.codec, 'record_modalities', None)
    if read is None:
        return {}
    groups: dict[str, list[int]] = {}
    for index, record in enumerate(dataset.records):
        groups.setdefault('+'.join(read(record)) or 'text', []).append(index)
    several = len(getattr(dataset.codec, 'modality_order', ())) > 1
    return groups if len(groups) > 1 or several else {}


def token_metrics(model, dataset, collate, batch_size: int, split: str, device='cpu',
                  groups: dict[str, list[int]] | None = None) -> dict:
    """Loss and accuracy of `model` on an encoded dataset as its codec scores them: answer
    tokens and next-token accuracy (<split>_token_acc) for text, the class per example for a
    classifier (<split>_acc). With `groups` ({label: record indices}) also each group's, as
    <split>_<label>_*, from the same forward passes (the whole set's are their sums)."""
    codec = dataset.codec
    parts = ({label: dataset.subset_at(indices) for label, indices in groups.items()}
             if groups else {None: dataset})
    stats = {label: _token_stats(model, part, collate, batch_size, device)
             for label, part in parts.items()}
    total = [sum(values) for values in zip(*stats.values())]
    results = _token_results(codec, split, *total, len(dataset))
    if groups:
        for label, part in parts.items():
            results.update(_token_results(codec, f'{split}_{label}', *stats[label], len(part)))
    return results


def _token_stats(model, dataset, collate, batch_size: int, device) -> tuple[float, int, int]:
    """(loss sum, correct, scored units) over `dataset`, as its codec scores them."""
    loss_sum, correct, tokens = 0.0, 0, 0
    for batch in eval_batches(dataset, collate, batch_size):
        labels = batch.pop('labels')
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        batch_loss, batch_correct, batch_tokens = dataset.codec.score(logits.cpu(), labels)
        loss_sum, correct, tokens = loss_sum + batch_loss, correct + batch_correct, tokens + batch_tokens
    return loss_sum, correct, tokens


def _token_results(codec, prefix: str, loss_sum: float, correct: int, tokens: int,
                   count: int) -> dict:
    return {f'{prefix}_avg_loss': loss_sum / max(tokens, 1),
            f'{prefix}_{codec.accuracy_metric}': correct / max(tokens, 1),
            f'{prefix}_total': count}


def generation_metrics(model, codec, records: list[dict], eval_cfg, batch_size: int, split: str,
                       device='cpu', predictions: tuple | None = None,
                       groups: dict[str, list[int]] | None = None) -> dict:
    """fsplug.eval.gen_metrics of greedy answers to the first fsplug.eval.max_gen_samples
    records; predictions=(path, client id) also writes the answers there. With `groups`
    ({label: record indices}) the cap applies per group (each test modality gets answers)
    and the same answers are also scored per group, as <split>_<label>_<metric>."""
    cap = eval_cfg.max_gen_samples
    groups = groups or {}
    chosen = (sorted(i for indices in groups.values() for i in indices[:cap or len(indices)])
              if groups else list(range(min(cap or len(records), len(records)))))
    records = [records[i] for i in chosen]
    answers = generate_answers(model, codec, records, batch_size, eval_cfg.max_new_tokens, device)
    references = [reference_answer(r) for r in records]
    if predictions:
        write_predictions(predictions[0], predictions[1], records, answers)
    configure_generation_metrics(eval_cfg)
    position = {index: k for k, index in enumerate(chosen)}
    scored = {split: list(range(len(records)))}
    for label, indices in groups.items():
        scored[f'{split}_{label}'] = [position[i] for i in indices if i in position]
    return {f'{prefix}_{name}': GENERATION_METRICS[name]([answers[k] for k in kept],
                                                         [references[k] for k in kept])
            for prefix, kept in scored.items() if kept for name in eval_cfg.gen_metrics}


def generate_answers(model, codec, records: list[dict], batch_size: int, max_new_tokens: int,
                     device='cpu') -> list[str]:
    """Greedy answers, `batch_size` left-padded prompts at a time."""
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=codec.pad_token_id, eos_token_id=codec.stop_token_id)
    answers = []
    for start in range(0, len(records), batch_size):
        batch = codec.prompt_batch(records[start:start + batch_size])
        batch = {k: v.to(device) for k, v in batch.items()}
        output = model.generate(**batch, generation_config=config)
        answers += [codec.decode(row) for row in output[:, batch['input_ids'].shape[1]:].cpu()]
    return answers


def write_predictions(path: str, client_id: int, records: list[dict], predictions: list[str]):
    import json
    import os
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    with open(path, 'w', encoding='utf-8') as handle:
        for record, prediction in zip(records, predictions):
            handle.write(json.dumps({
                'client': client_id, 'id': record.get('id'),
                'question': record.get('question', record.get('instruction')),
                'prediction': prediction, 'reference': reference_answer(record)}) + '\n')
