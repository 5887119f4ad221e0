"""UniFLoW (Universal multi-modal Federated LoRA fine-tuning framework With Analytical
aggregation): LoRA on the modality encoders and on the LLM of an encoder + LLM model
(builder `imagebind_vicuna`, §3.1 Eq. 1-6), both federated, with II-stage local training
(Eq. 7): a local step s < τ·S (S steps per round) updates only the encoder side, later steps
only the LLM LoRA. The server aggregates with FedA²-LoRA (§3.2, Alg. 1) or, for the paper's
tables, another registered LoRA aggregation (`aggregation`), whose own `fsplug.<name>` node
applies (e.g. fsplug.fed_a2.ridge; Table 12 uses λ = 0.1 for image / audio).

Schedules (Appendix E.8): `two_stage` (Eq. 7); `reverse` (LLM first, then the encoders:
Table 14's "Reverse"); `round` (the encoder side in rounds t < switch_round·R, the LLM after:
Table 15's T = 0.5·CR; Algorithm 1 line 25 writes this `t < τ` form); `simultaneous` (both
every step: Table 14's plain FedA²-LoRA).

Choice: the paper names only encoder and LLM LoRA in its stages; the projections P_m
(Eq. 3) train with the encoder side by default (`projector_stage`).
"""
from dataclasses import dataclass

from fs_plugins.methods.base import Method, Phase
from fs_plugins.methods.registry import get_method_class, register_method
from fs_plugins.models.encoder_llm import modalities
from fs_plugins.schema import option

SCHEDULES = ('two_stage', 'reverse', 'round', 'simultaneous')
AGGREGATIONS = ('fed_a2', 'fedavg', 'ffa', 'fedsa', 'fedex')
PROJECTOR_STAGES = ('encoder', 'llm', 'both')
ENCODER_PART, LLM_PART, PROJECTOR_PART = 'encoders.', 'language_model.', 'projectors.'
BUILDER = 'imagebind_vicuna'
# the Method hooks the chosen aggregation method answers (everything but the local schedule)
DELEGATED_HOOKS = ('adapt_model', 'after_build', 'init_client_state', 'learning_rates',
                   'is_shared', 'shared_tensors', 'loss', 'before_optimizer_step', 'after_step',
                   'client_extra', 'client_metrics', 'receive', 'artifact_extra',
                   'restore_artifact', 'init_server_state', 'aggregate', 'content_for',
                   'client_groups')


@dataclass
class UniFLoWConfig:
    aggregation: str = option('fed_a2', "server aggregation of the encoder and LLM LoRA: the "
                                        'registered method of that name (its fsplug.<name> '
                                        'node applies)', choices=AGGREGATIONS)
    schedule: str = option('two_stage', "'two_stage': steps s < τ·S train the encoder side, "
                                        "the rest the LLM LoRA (Eq. 7); 'reverse': the LLM "
                                        "first (Table 14); 'round': the encoder side in rounds "
                                        "t < switch_round·R, the LLM after (Table 15); "
                                        "'simultaneous': both every step", choices=SCHEDULES)
    tau: float = option(0.25, "τ: fraction of a round's local steps on the encoder side "
                              '(two_stage, reverse; Fig. 3b peaks at 0.25)', ge=0, le=1)
    switch_round: float = option(0.5, "schedule 'round': fraction of the rounds on the encoder "
                                      'side (T = 0.5·CR)', ge=0, le=1)
    projector_stage: str = option('encoder', 'which side trains the projections P_m (Eq. 3)',
                                  choices=PROJECTOR_STAGES)


@register_method
class UniFLoW(Method):
    name = 'uniflow'
    summary = ('UniFLoW: LoRA on modality encoders and LLM, II-stage local training (encoder '
               'LoRA for τ·S steps, then LLM LoRA), FedA²-LoRA (or fedavg/ffa/fedsa/fedex) '
               'aggregation')
    sent = "encoder + LLM LoRA (and P) / the same, as the chosen aggregation sends"
    config_class = UniFLoWConfig
    hf_export_refusal = ('an encoder + LLM model (builder imagebind_vicuna) splices features '
                         'into the prompt; it is not one Hugging Face model')

    def __init__(self, cfg):
        self._client_id = None
        super().__init__(cfg)
        self.aggregator = get_method_class(self.hparams.aggregation)(cfg)
        self.modifies_frozen_weights = self.aggregator.modifies_frozen_weights
        for hook in DELEGATED_HOOKS:
            setattr(self, hook, getattr(self.aggregator, hook))

    @property
    def client_id(self):
        return self._client_id

    @client_id.setter
    def client_id(self, value):
        self._client_id = value
        if 'aggregator' in self.__dict__:
            self.aggregator.client_id = value

    @classmethod
    def config_problems(cls, hparams, cfg):
        model = cfg['fsplug']['model']
        if model['builder'] != BUILDER:
            return [f"fsplug.model.builder = '{model['builder']}': fsplug.method = 'uniflow' "
                    f"needs '{BUILDER}' (encoders + LLM)"]
        aggregation = get_method_class(hparams.aggregation)
        problems = aggregation.config_problems(aggregation.options(cfg), cfg)
        if hparams.schedule != 'simultaneous' and hparams.projector_stage == 'llm':
            encoders = model['multimodal']
            if not any(encoders[m]['lora_targets'] for m in modalities()
                       if encoders[m]['backend']) and not model['vision']['train_tower']:
                problems.append("fsplug.uniflow.projector_stage = 'llm' with no encoder LoRA "
                                "(fsplug.model.multimodal.<modality>.lora_targets): the encoder "
                                "stage would train nothing")
        return problems

    # ------------------------------------------------------------------ schedule
    def trains_encoder_side(self, name: str) -> bool:
        return ENCODER_PART in name or (PROJECTOR_PART in name
                                        and self.hparams.projector_stage != 'llm')

    def trains_llm_side(self, name: str) -> bool:
        return LLM_PART in name or (PROJECTOR_PART in name
                                    and self.hparams.projector_stage != 'encoder')

    def phases(self, num_steps, cfg):
        encoder = Phase('encoder', 0, self.trains_encoder_side)
        llm = Phase('llm', 0, self.trains_llm_side)
        schedule = self.hparams.schedule
        if schedule == 'simultaneous':
            return [Phase('both', num_steps,
                          lambda n: self.trains_encoder_side(n) or self.trains_llm_side(n))]
        if schedule == 'round':
            switch = self.hparams.switch_round * int(cfg.federate.total_round_num)
            first = encoder if self.round_idx < switch else llm
            first.steps = num_steps
            return [first]
        encoder.steps = int(round(self.hparams.tau * num_steps))
        llm.steps = num_steps - encoder.steps
        return [encoder, llm] if schedule == 'two_stage' else [llm, encoder]
