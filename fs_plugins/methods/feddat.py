"""FedDAT (Chen et al., AAAI 2024, "FedDAT: An Approach for Foundation Model Finetuning in
Multi-Modal Heterogeneous Federated Learning"; public code HaokunChen245/FedDAT) with LoRA
adapters in place of its bottleneck adapters, as FedMosaic's tables use it (A.9: "triple
adapter").

Every client holds three adapters on the same layers:
- 'default' — the shared adapter A_s' (code: adapter_1): trained, sent, averaged;
- 'dat_local' — the client-specific adapter A_c (adapter_0): trained, never sent;
- 'dat_global' — a frozen copy of the global adapter received this round (adapter_2).
The Dual-Adapter Teacher (DAT) is the model with A_c and the frozen global copy both active,
each at half weight (the code's fixed 0.5 / 0.5 mix): their LoRA scaling is halved.

Mutual knowledge distillation, local round: the code takes two optimiser steps per batch,
first on A_s' (student; teacher: the DAT), then on A_c inside the DAT (teacher: the A_s'
model), each with loss (1 − w)·task + w·T²·KL(teacher ‖ student), w = 0.5, T = 3, the
teacher's output detached. Here the two steps alternate over consecutive batches (one
optimiser step per batch in both runners), for one local pass each, and the teacher's logits
come from a no-grad forward pass on the same batch; the KL runs over the answer tokens.
Evaluation and saved models use the DAT with the latest global adapter received.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fs_plugins.data.instruction import IGNORE_INDEX
from fs_plugins.methods.base import Method, Phase, activate_adapters, copy_adapter, load_tensors
from fs_plugins.methods.dual_adapter import add_twin_adapter, needs_lora_adapter
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

SHARED, DAT_LOCAL, DAT_GLOBAL = 'default', 'dat_local', 'dat_global'
STUDENT, TEACHER = (SHARED,), (DAT_LOCAL, DAT_GLOBAL)


@dataclass
class FedDATConfig:
    kd_weight: float = option(0.5, 'w of (1 − w)·task loss + w·T²·KL(teacher ‖ student) in both '
                                   'distillation steps (code: 0.5 / 0.5)', ge=0, le=1)
    kd_temperature: float = option(3.0, 'T of the mutual distillation (code: 3)', gt=0)


def is_dat(name: str) -> bool:
    """A tensor of the teacher's own adapters (the rest, e.g. a trained projector, is shared)."""
    return f'.{DAT_LOCAL}.' in name or f'.{DAT_GLOBAL}.' in name


def distillation_loss(student_logits, teacher_logits, labels, temperature: float) -> torch.Tensor:
    """T²·KL(softmax(t/T) ‖ softmax(s/T)), mean over the answer tokens (position i predicts
    token i + 1; only targets != IGNORE_INDEX count)."""
    mask = labels[:, 1:] != IGNORE_INDEX
    student = student_logits[:, :-1][mask].float() / temperature
    teacher = teacher_logits[:, :-1][mask].float() / temperature
    if not mask.any():
        return student.sum() * 0.0
    kl = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                  reduction='batchmean')
    return kl * temperature ** 2


@register_method
class FedDAT(Method):
    name = 'feddat'
    summary = ('FedDAT: shared LoRA (averaged) + dual-adapter teacher (local LoRA + frozen '
               'global copy, half weight each), mutual distillation between them')
    sent = 'shared A, B / shared A, B'
    config_class = FedDATConfig
    inference_adapters = TEACHER
    # FedMosaic Table 15: "Double Forward/Backward" (student and teacher steps), 2.564 × SFT;
    # this FedDAT's round measures about 3.0 × (its mutual distillation runs both adapters in
    # each step), so matched compute uses the measured cost
    relative_cost = None
    paper_relative_cost = 2.564

    @classmethod
    def config_problems(cls, hparams, cfg):
        return needs_lora_adapter(cls.name, cfg)

    def adapt_model(self, model, cfg):
        # the DAT averages its two adapters: each at half the LoRA scaling
        add_twin_adapter(model, DAT_LOCAL, weight=0.5)
        add_twin_adapter(model, DAT_GLOBAL, weight=0.5, trainable=False)
        copy_adapter(model, SHARED, DAT_GLOBAL)
        activate_adapters(model, self.inference_adapters)
        return model

    def is_shared(self, name):
        return not is_dat(name)

    def phases(self, num_steps, cfg):
        shared = Phase('shared', 1, lambda n: not is_dat(n), adapters=STUDENT)
        dat = Phase('dat', 1, lambda n: f'.{DAT_LOCAL}.' in n, adapters=TEACHER)
        return [shared, dat] * num_steps

    def receive(self, model, content, state):
        load_tensors(model, content)
        copy_adapter(model, SHARED, DAT_GLOBAL)

    def loss(self, model, batch, state):
        active = tuple(model.base_model.active_adapters)
        other = TEACHER if active == STUDENT else STUDENT
        output = model(**batch)
        with torch.no_grad():
            activate_adapters(model, other)
            teacher_logits = model(**batch).logits
            activate_adapters(model, active)
        w = self.hparams.kd_weight
        kd = distillation_loss(output.logits, teacher_logits, batch['labels'],
                               self.hparams.kd_temperature)
        return (1 - w) * output.loss + w * kd
