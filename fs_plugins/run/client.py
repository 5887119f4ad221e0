"""One client's side of a round, shared by the FS trainer and the embedded runner.

The FS trainer calls the step-level pieces from its hooks (`begin_round`, `next_batch`,
`compute_loss`, `optimise`, `record`, `end_round`); the embedded runner calls `run_round`,
which is the same sequence. The client's model, its persistent `state` and its batch stream
live here, so client-local parameters and counters survive across rounds in both runners.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time

import torch

from fs_plugins.core.seeding import derive_seed, use_deterministic_algorithms
from fs_plugins.data import stream
from fs_plugins.data.batches import BatchStream, local_steps
from fs_plugins.data.federated import nothing_fits_error
from fs_plugins.methods.base import ClientUpdate, Method, Phase, activate_adapters
from fs_plugins.models.builders import BuiltModel
from fs_plugins.models.codecs import EncodedDataset
from fs_plugins.models.precision import DTYPES, forward_context, grad_scaler, place_model
from fs_plugins.run.artifacts import client_dir, save_client_model
from fs_plugins.run.evaluation import EvalTimes, evaluation_metrics, modality_groups, token_metrics
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


def trained_tokens(batch: dict) -> int:
    """Non-padding input tokens of a (CPU) micro-batch: its attention mask's ones, else every
    input id."""
    mask = batch.get('attention_mask')
    return int(mask.sum()) if mask is not None else int(batch['input_ids'].numel())


class RoundClock:
    """Wall seconds of a client's local rounds (time.perf_counter, no device sync: on an
    accelerator a part ends where the host next waits). `extra_s`: the method's work beside the
    plain training step, timed around its hooks (receive, phases, before_optimizer_step,
    after_step, client_extra, client_metrics, NbAFL's noise) and, inside Method.loss,
    everything but the model's own forward passes (FedMosaic's RELA gradients on W_s, FedProx's
    proximal term); receives between two rounds count towards the next. `train_s`: the rest of
    the round from begin_round to end_round (batches, forwards, backwards, optimiser steps)."""

    def __init__(self):
        self.extra_s = 0.0
        self.started = self.extra_at_start = 0.0
        self.tokens = 0

    def begin(self) -> None:
        self.started, self.extra_at_start, self.tokens = time.perf_counter(), self.extra_s, 0

    @contextlib.contextmanager
    def extra(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.extra_s += time.perf_counter() - started

    @contextlib.contextmanager
    def extra_beside(self, model: torch.nn.Module):
        """The block's seconds count as extra, less those inside `model`'s forward passes
        (forward hooks, present only for the block)."""
        forward_s, opened = [0.0], []

        def opening(module, args):
            opened.append(time.perf_counter())

        def closing(module, args, output):
            forward_s[0] += time.perf_counter() - opened.pop()
        handles = (model.register_forward_pre_hook(opening), model.register_forward_hook(closing))
        started = time.perf_counter()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.extra_s += max(0.0, time.perf_counter() - started - forward_s[0])

    def take(self) -> dict:
        """The round's train_s, extra_s and tokens_per_s (trained tokens / train_s); extra
        starts again from 0."""
        extra_in_round = self.extra_s - self.extra_at_start
        train_s = max(0.0, time.perf_counter() - self.started - extra_in_round)
        times = {'train_s': train_s, 'extra_s': self.extra_s,
                 'tokens_per_s': self.tokens / train_s if train_s > 0 else 0.0}
        self.extra_s = 0.0
        return times


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
        self.clock = RoundClock()
        self.eval_times = EvalTimes()   # evaluate()'s seconds, until take_eval_times()

    # ------------------------------------------------------------------ receive
    def receive(self, content: dict) -> None:
        with self.clock.extra():
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
        self.clock.begin()
        torch.manual_seed(derive_seed(self.cfg.seed, 'local_round', self.client_id, self.round_idx))
        if self.dynamic:
            self.stream.set_memory(self.memory_size(self.round_idx))
        self.method.round_idx = self.round_idx
        place_model(self.model, self.device)
        with self.clock.extra():
            self.step_phases = self._round_phases() if self.method.trains else []
        steps = len(self.step_phases)
        self.flop_counter.stop()
        self.phase_flops = {}   # FLOPs of the round's first step of each phase
        self.model.train()
        self.optimizer = self.scheduler = None   # a method that trains nothing has neither
        if steps:
            self.optimizer = build_optimizer(self._param_groups(), self.cfg.train.optimizer)
            total, start = schedule_window(self.cfg.fsplug.train.lr_schedule, self.round_idx,
                                           int(self.cfg.federate.total_round_num), steps)
            self.scheduler = build_scheduler(self.optimizer, self.cfg.train.scheduler, total, start)
        self.scaler = grad_scaler(self.device, self.dtype)
        self.step_index, self.current_phase = 0, None
        self.pending: list[tuple[dict, float]] = []   # the open step's micro-batches to come
        self.stats = {'loss_sum': 0.0, 'samples': 0, 'steps': 0, 'skipped': 0}
        return steps * self.accumulation

    def _round_phases(self) -> list[Phase]:
        """The phase of each local step of this round (Method.phases, matched compute)."""
        phases = self.method.phases(self.steps_per_round(), self.cfg)
        if self.cfg.fsplug.train.local_compute == 'matched':
            phases = matched_phases(phases, self.relative_cost())
        return expand_phases(phases)

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
        self.clock.tokens += trained_tokens(batch)
        self.method.micro_index = self.accumulation - len(self.pending) - 1
        return {k: v.to(self.device) for k, v in batch.items()}

    def compute_loss(self, batch: dict) -> torch.Tensor:
        with self.clock.extra_beside(self.model), forward_context(self.device, self.dtype):
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
            with self.clock.extra():
                self.method.before_optimizer_step(self.model, self.state)
            clip = self.cfg.grad.grad_clip
            if clip > 0:
                torch.nn.utils.clip_grad_norm_([self.params[n] for n in self.trainable_names], clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scheduler is not None:
                self.scheduler.step()
        with self.clock.extra():
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
        with self.clock.extra():
            extra = self.method.client_extra(self.model, self.state)
            method_metrics = self.method.client_metrics(self.model, self.state)
        metrics = {'train_avg_loss': self.stats['loss_sum'] / samples if samples else float('nan'),
                   'train_steps': self.stats['steps'],
                   # the round's compute (fsplug.train.local_compute): optimiser steps planned,
                   # FLOPs (fs_plugins.run.flops), the relative cost to SFT used or declared
                   'local_steps': len(self.step_phases), 'local_flops': self.round_flops(),
                   **method_metrics}
        cost = self.relative_cost()
        if cost is not None:
            metrics['relative_cost'] = cost
        nbafl = nbafl_settings(self.cfg)
        if nbafl is not None:   # NbAFL clips and noises the upload only, not the client's model
            with self.clock.extra():
                shared = private_upload(shared, nbafl, len(self.train_data), int(self.cfg.seed),
                                        self.client_id, self.round_idx)
            metrics['nbafl_sigma_u'] = upload_sigma(nbafl, len(self.train_data))
        metrics.update(self.clock.take())
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

    def evaluate_splits(self, splits=EVAL_SPLITS) -> dict:
        """evaluate() on each split, with the seconds it took (take_eval_times): an eval row."""
        metrics = {}
        for split in splits:
            metrics.update(self.evaluate(split))
        return {**metrics, **self.take_eval_times()}

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
        path = self.predictions_path if split == 'test' else None
        times = self.eval_times
        started = time.perf_counter()
        try:
            with forward_context(self.device, self.dtype):
                results = evaluation_metrics(self.model, dataset, self.cfg.fsplug.eval,
                                             self._eval_batch_size(), split, self.device,
                                             predictions=(path, self.client_id) if path else None,
                                             groups=modality_groups(dataset), times=times)
        finally:
            self.model.train(was_training)
            times.add('eval', time.perf_counter() - started)
        return results

    def take_eval_times(self) -> dict:
        """{'eval_s', 'eval_prefill_s', 'eval_generate_s'}: seconds evaluate() spent since the
        last call (all of it; the forward passes over prompts and examples; the new tokens'
        decoding), then reset to 0."""
        return self.eval_times.take()

    def _eval_batch_size(self) -> int:
        return self.cfg.fsplug.eval.batch_size or self.batch_size

    def _token_metrics(self, dataset, split: str) -> dict:
        """The token metrics alone (`evaluate` without generation)."""
        return token_metrics(self.model, dataset, self.collate, self._eval_batch_size(), split,
                             self.device, groups=modality_groups(dataset))


def micro_batch_weights(batches: list[dict], loss_units) -> list[tuple[dict, float]]:
    """(micro-batch, weight) pairs of one optimiser step: each mean loss weighted by its share
    of the step's loss terms (`loss_units`), so Σ weight·loss is the mean over all of them."""
    units = [loss_units(batch) for batch in batches]
    total = sum(units)
    if not total:
        return [(batch, 1.0 / len(batches)) for batch in batches]
    return [(batch, count / total) for batch, count in zip(batches, units)]

