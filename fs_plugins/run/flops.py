"""FLOPs of a client's local steps, counted with torch.utils.flop_counter.FlopCounterMode.

The counter sees matrix products, convolutions and attention (2 FLOPs per multiply-add), in
the forward and the backward pass; elementwise work (activations, norms, a proximal term, the
optimiser's update) is not counted. FedMosaic (A.8, Table 15) compares methods by "FLOPs per
iteration" relative to SFT, one forward and backward; here SFT is FedAvg-LoRA's step.

- `StepCounter`: counts what runs between `start()` and `stop()`; the client procedure
  (fs_plugins.run.client) counts the round's first step of each phase with it, in place, and
  multiplies by that phase's steps (the `local_flops` of every train row);
- `step_flops(procedure, phase)`: one optimiser step of `phase` (all its micro-batches) on a
  fixed batch, outside training: the model, gradients, trainable flags, active adapters, the
  method's state and the random generators are left as they were; `sft=True` counts the SFT
  step instead;
- `measured_relative_cost(procedure)`: the method's round (every phase at
  train.local_update_steps) over SFT's, one counted step per phase, for
  fsplug.train.local_compute 'matched' when neither the config nor the method gives a ratio.

The SFT step runs on the same model: the plain answer-token loss with only peft's 'default'
adapter active, the method's other adapters frozen. Modules a method adds outside peft's
adapters stay in that reference, so their extra cost is not seen: such a method declares its
ratio (`Method.relative_cost`).
"""
from __future__ import annotations

import copy
import logging

import torch
from torch.utils.flop_counter import FlopCounterMode

from fs_plugins.methods.base import Phase, activate_adapters
from fs_plugins.models.precision import forward_context, place_model

logger = logging.getLogger(__name__)

DEFAULT_ADAPTER = 'default'


class StepCounter:
    """FLOPs of the work between `start()` and `stop()` (each call of `stop` returns them)."""

    def __init__(self):
        self._mode: FlopCounterMode | None = None

    @property
    def running(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        if self._mode is None:
            self._mode = FlopCounterMode(display=False)
            self._mode.__enter__()

    def stop(self) -> int:
        if self._mode is None:
            return 0
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        return int(mode.get_total_flops())


def phase_key(phase: Phase) -> tuple:
    """Phases that train the same parameters with the same adapters cost the same per step
    (FedDAT's round repeats two phases of one step each)."""
    return phase.name, id(phase.trainable), phase.adapters


def reference_batches(procedure) -> list[dict]:
    """The micro-batches of one optimiser step that `step_flops` uses: the client's first
    dataloader.batch_size × grad.grad_accum_count training examples, in order (its batch
    stream is not drawn from)."""
    data, size = procedure.train_data, procedure.batch_size
    return [procedure.collate([data[(k * size + i) % len(data)] for i in range(size)])
            for k in range(procedure.accumulation)]


def step_flops(procedure, phase: Phase | None = None, batches: list[dict] | None = None,
               sft: bool = False, steps: int = 1) -> int:
    """FLOPs of one optimiser step (forward and backward of each micro-batch) of `phase` (None:
    the method's first phase at one step) of a client's procedure (fs_plugins.run.client.
    ClientProcedure), on `batches` (default `reference_batches`); `sft`: the SFT step on the
    same model instead. `steps` > 1: that many consecutive steps, the method's `after_step`
    between them (its state advancing as in training: `Method.cost_period`), their mean.
    Leaves the model and the client as they were."""
    model, method = procedure.model, procedure.method
    batches = batches if batches is not None else reference_batches(procedure)
    if phase is None and not sft:
        phase = method.phases(1, procedure.cfg)[0]
    params = dict(model.named_parameters())
    flags = {n: p.requires_grad for n, p in params.items()}
    grads = {n: p.grad for n, p in params.items()}
    active = active_adapters(model)
    was_training = model.training
    attributes = dict(vars(method))
    try:
        state = copy.deepcopy(procedure.state)
    except Exception as exc:   # noqa: BLE001 -- a state that cannot be copied is left as it is
        logger.warning(f'step_flops: the method state could not be copied ({exc}); counting '
                       f'may change it')
        state = None
    place_model(model, procedure.device)
    model.train()
    device = procedure.device
    counter = StepCounter()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == 'cuda' else []):
            trainable = _enter(procedure, phase, sft)
            counter.start()
            for step in range(steps):
                for index, batch in enumerate(batches):
                    method.micro_index = index
                    batch = {k: v.to(device) for k, v in batch.items()}
                    with forward_context(device, procedure.dtype):
                        loss = model(**batch).loss if sft else method.loss(model, batch, procedure.state)
                    if (sft or not method.gradient_free) and trainable:
                        loss.backward()
                if step + 1 < steps:
                    method.after_step(model, procedure.state)
            return round(counter.stop() / steps)
    finally:
        counter.stop()
        for name, param in params.items():
            param.grad = grads[name]
            param.requires_grad_(flags[name])
        if active:
            activate_adapters(model, active)
        model.train(was_training)
        vars(method).clear()
        vars(method).update(attributes)
        if state is not None:
            procedure.state.clear()
            procedure.state.update(state)


def _enter(procedure, phase: Phase | None, sft: bool) -> list[str]:
    """Sets the active adapters and trainable flags of `phase` (or of the SFT step); returns
    the names that train."""
    model, names = procedure.model, procedure.trainable_names
    params = dict(model.named_parameters())
    if sft:
        adapters = set(getattr(model, 'peft_config', {}) or {})
        others = adapters - {DEFAULT_ADAPTER}
        if DEFAULT_ADAPTER in adapters:
            activate_adapters(model, (DEFAULT_ADAPTER,))
        trains = [n for n in names if not any(f'.{a}.' in n or n.endswith(f'.{a}') for a in others)]
    else:
        if phase.adapters:
            activate_adapters(model, phase.adapters)
        trains = [n for n in names if phase.trainable is None or phase.trainable(n)]
    chosen = set(trains)
    for name in names:
        params[name].requires_grad_(name in chosen)
    return trains


def active_adapters(model) -> tuple[str, ...]:
    """The peft adapters active in `model`'s forward pass (() for a model without peft)."""
    base = getattr(model, 'base_model', None)
    if base is None or not hasattr(model, 'peft_config'):
        return ()
    active = base.active_adapters
    return tuple([active] if isinstance(active, str) else active)


def measured_relative_cost(procedure, batches: list[dict] | None = None) -> float:
    """FLOPs of the method's local round with every phase at train.local_update_steps over
    SFT's round: Σ_phases steps × FLOPs of one step / (S × FLOPs of one SFT step), one step of
    each distinct phase counted on the same batch (the mean of `Method.cost_period` steps where
    the method's work repeats over several: FedMosaic's RELA every f steps)."""
    steps = procedure.steps_per_round()
    batches = batches if batches is not None else reference_batches(procedure)
    sft = step_flops(procedure, batches=batches, sft=True)
    if sft <= 0:
        raise ValueError(f'Client {procedure.client_id}: the SFT step counted no FLOPs; set '
                         f'fsplug.train.relative_cost')
    per_phase: dict[tuple, int] = {}
    period = max(1, int(procedure.method.cost_period(procedure.cfg)))
    total = 0
    for phase in procedure.method.phases(steps, procedure.cfg):
        if phase.steps <= 0:
            continue
        key = phase_key(phase)
        if key not in per_phase:
            per_phase[key] = step_flops(procedure, phase, batches, steps=period)
        total += phase.steps * per_phase[key]
    cost = total / (steps * sft)
    logger.info(f'Client {procedure.client_id}: measured relative cost {cost:.4g} × SFT '
                f'({len(per_phase)} phase(s) counted, SFT step {sft:.4g} FLOPs)')
    return cost
