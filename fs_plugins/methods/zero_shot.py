"""Zero-shot: the model the YAML builds, evaluated without any training — UniFLoW's '-' rows
(Tables 1-3, 8, 10, 11, 13-15, 17, 18: "'-' indicates methods where no training was
conducted"; the same numbers in Tables 1-3, whichever clients would train, since nothing does).

The model is the base of fsplug.model with no peft adapter (fsplug.model.lora is unused) and
every other module the builder makes as it initialises it, frozen: for UniFLoW's
`imagebind_vicuna`, the LLM and encoders as loaded and the projections P_m (Eq. 3) at their
seeded initialisation, which is the global model before round 1 (a LoRA with B = 0 would change
nothing). `trains = False` (fs_plugins/methods/base.py) says the rest once: a round has no
local step and builds no optimiser, nothing is uploaded or sent down (0 bytes each way), the
server's state stays empty, and every evaluation round scores the same model. The same YAMLs
and summaries as the trained rows apply: run a table's YAML with fsplug.method zero_shot
(federate.total_round_num 1 is enough: every round evaluates the same model)."""
from __future__ import annotations

from fs_plugins.methods.registry import register_method
from fs_plugins.methods.standalone import NothingSent


@register_method
class ZeroShot(NothingSent):
    name = 'zero_shot'
    summary = ("the built base model evaluated without training (UniFLoW's '-' rows): no "
               'adapter, every weight frozen, no local step')
    sent = 'nothing / nothing'
    uses_peft_adapter = False
    trains = False
    hf_export_refusal = 'nothing was trained: the model is the base model.type itself'

    def adapt_model(self, model, cfg):
        """Freezes what the builder made trainable (a projector, a classifier's head)."""
        for param in model.parameters():
            param.requires_grad_(False)
        return model

    def phases(self, num_steps, cfg):
        return []
