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

Heterogeneous modalities (§3.1: client k's data has modalities m ∈ M_avail, and its encoder
LoRA Φ_E,k^(m) of Eq. 2 exists for those): a client trains and uploads the encoder LoRA and P_m
(`encoders.<m>.*`, `projectors.<m>.*`) of its own modalities only; those of any other configured
modality are frozen when its model is built (in no phase, not sent), and it still receives
their global version. Its modalities are `client_modalities`, set per client in --client_cfg,
or 'auto': `resolve_client_config` writes those of its training records into its config when
the runner builds it from its split, so its upload follows from its config (the server's
expected shapes, saved models). The server runs the chosen aggregation once per set of clients
that sent the same tensors (`upload_groups`): each modality's modules over its holders only,
weights renormalised over them, the LLM LoRA over everyone; a module nobody sent keeps its value.
"""
import math
from dataclasses import dataclass, replace

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.pairs import is_lora_factor
from fs_plugins.methods.base import Contract, Method, PaperClaim, Phase, weights_of
from fs_plugins.methods.registry import get_method_class, register_method
from fs_plugins.models.encoder_llm import modalities, modality_of, records_modalities
from fs_plugins.schema import option

SCHEDULES = ('two_stage', 'reverse', 'round', 'simultaneous')
AGGREGATIONS = ('fed_a2', 'fedavg', 'ffa', 'fedsa', 'fedex')
PROJECTOR_STAGES = ('encoder', 'llm', 'both')
ENCODER_PART, LLM_PART, PROJECTOR_PART = 'encoders.', 'language_model.', 'projectors.'
BUILDER = 'imagebind_vicuna'
AUTO = 'auto'
CLIENT_MODALITIES = (AUTO, *modalities())
# the Method hooks the chosen aggregation method answers (everything but the local schedule)
DELEGATED_HOOKS = ('after_build', 'init_client_state', 'learning_rates',
                   'is_shared', 'shared_tensors', 'loss', 'before_optimizer_step', 'after_step',
                   'client_extra', 'extra_payload_shapes', 'client_metrics', 'receive', 'artifact_extra',
                   'restore_artifact', 'init_server_state', 'content_for',
                   'client_groups')


def encoder_steps(tau: float, num_steps: int) -> int:
    """How many of a round's S local steps train the encoder side: Eq. 7's "step < τ" with
    the step counted as a fraction of the round, s/S < τ for s = 0..S-1, i.e. ⌈τ·S⌉ (τ·S
    rounded to 9 decimals first, so 0.3 · 10 gives 3, not 4)."""
    return min(num_steps, math.ceil(round(tau * num_steps, 9)))


def upload_groups(updates) -> list[tuple[frozenset, list[str]]]:
    """The shared tensor names grouped by the set of clients that sent them ((client ids,
    names)), the group sent by most clients first: with clients of different modalities, the
    LLM's tensors (everyone) and each modality's modules (its holders)."""
    holders: dict[str, set] = {}
    for update in updates:
        for name in update.shared:
            holders.setdefault(name, set()).add(update.client_id)
    groups: dict[frozenset, list[str]] = {}
    for name, clients in holders.items():
        groups.setdefault(frozenset(clients), []).append(name)
    return sorted(groups.items(), key=lambda g: (-len(g[0]), sorted(g[0])))


def merge_states(previous: dict, results: list[dict]) -> dict:
    """The server state after aggregating groups of tensors separately, `results` being the
    states each group's call returned: per dict-valued entry (e.g. FedEx's residuals per
    layer), what any call changed; any other entry (e.g. FedA²'s round counter, the same in
    every call) from the first call. 'global' is left to the caller."""
    out = dict(previous)
    for key, value in previous.items():
        if key == 'global':
            continue
        if isinstance(value, dict):
            merged = dict(value)
            for state in results:
                merged.update({k: v for k, v in state.get(key, {}).items()
                               if value.get(k) is not v})
            out[key] = merged
        elif results:
            out[key] = results[0].get(key, value)
    for state in results:   # entries a call added to the state
        out.update({k: v for k, v in state.items() if k not in out})
    return out


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
                              '(two_stage, reverse; Fig. 3b peaks at 0.25): steps s with '
                              's/S < τ, ⌈τ·S⌉ of the S (Eq. 7)', ge=0, le=1)
    switch_round: float = option(0.5, "schedule 'round': fraction of the rounds on the encoder "
                                      'side (T = 0.5·CR)', ge=0, le=1)
    projector_stage: str = option('encoder', 'which side trains the projections P_m (Eq. 3)',
                                  choices=PROJECTOR_STAGES)
    client_modalities: list[str] = option(
        [AUTO], "the modalities M_avail of this client (§3.1; set per client in --client_cfg): "
                'only their encoder LoRA and projection P_m train and are uploaded, the other '
                "configured modalities' modules stay frozen at the global version it receives. "
                "'auto': the modalities of the client's training records (resolved when the "
                "runner builds the client from its split); in the run's own config (the "
                "server's global model) every configured modality",
        choices=CLIENT_MODALITIES, min_items=1)


@register_method
class UniFLoW(Method):
    name = 'uniflow'
    robust_aggregation_refusal = "its LoRA aggregation is another method's (fsplug.uniflow.aggregation)"
    summary = ('UniFLoW: LoRA on modality encoders and LLM, II-stage local training (encoder '
               'LoRA for τ·S steps, then LLM LoRA), FedA²-LoRA (or fedavg/ffa/fedsa/fedex) '
               'aggregation')
    sent = "encoder + LLM LoRA (and P) / the same, as the chosen aggregation sends"
    config_class = UniFLoWConfig
    hf_export_refusal = ('an encoder + LLM model (builder imagebind_vicuna) splices features '
                         'into the prompt; it is not one Hugging Face model')
    contract = Contract(claim=PaperClaim(
        source='UniFLoW paper, Appendix E.1 and Table 7 (RTE and QNLI, per-round communicated '
               'parameters): LoRA 0.78M, FedA²-LoRA 0.78M (FFA-LoRA and FedSA-LoRA 0.39M, '
               'FedEx-LoRA 25.74M); "the number of trainable parameters and the per-round '
               'communicated parameters are the same as standard LoRA (1.83M / 0.78M)" (the '
               'aggregation fed_a2)',
        up_ratio=1.0))

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
        listed = list(hparams.client_modalities)
        if AUTO in listed and len(listed) > 1:
            problems.append(f"fsplug.uniflow.client_modalities = {listed}: '{AUTO}' stands alone "
                            f"(or list the client's modalities)")
        for modality in listed:
            if modality != AUTO and not model['multimodal'][modality]['backend']:
                problems.append(f"fsplug.uniflow.client_modalities lists '{modality}', which has "
                                f"no encoder (fsplug.model.multimodal.{modality}.backend)")
        return problems

    # ---------------------------------------------------------- client modalities
    @staticmethod
    def configured_modalities(cfg) -> tuple[str, ...]:
        """The modalities with an encoder in the model of `cfg`."""
        encoders = cfg['fsplug']['model']['multimodal']
        return tuple(m for m in modalities() if encoders[m]['backend'])

    @classmethod
    def own_modalities(cls, cfg) -> tuple[str, ...]:
        """M_avail of the participant with config `cfg`: fsplug.uniflow.client_modalities, or
        every configured modality when it is 'auto' (not resolved from records: the server's
        global model)."""
        configured = cls.configured_modalities(cfg)
        listed = list((cfg['fsplug'].get(cls.name) or {}).get('client_modalities', [AUTO]))
        return configured if AUTO in listed else tuple(m for m in configured if m in listed)

    @classmethod
    def resolve_client_config(cls, cfg, records) -> None:
        """'auto': the client's modalities are those of its training records, written into its
        config before its model is built, so its trainable and uploaded tensors follow from its
        config (the server builds its expected upload from it; saved models carry it). A client
        holding every configured modality keeps 'auto' (its config stays the run's)."""
        node = cfg['fsplug'].get(cls.name)
        if node is None or AUTO not in list(node['client_modalities']):
            return
        configured = cls.configured_modalities(cfg)
        present = tuple(m for m in records_modalities(records.get('train') or [])
                        if m in configured)
        if present and present != configured:
            node['client_modalities'] = list(present)

    def adapt_model(self, model, cfg):
        """The aggregation's adapter changes, then the modules of every configured modality this
        client does not hold (`encoders.<m>.*`, `projectors.<m>.*`) frozen: not trained in any
        phase, not uploaded; the client still loads their global version (receive)."""
        model = self.aggregator.adapt_model(model, cfg)
        absent = set(self.configured_modalities(cfg)) - set(self.own_modalities(cfg))
        if absent:
            for name, param in model.named_parameters():
                if modality_of(name) in absent:
                    param.requires_grad_(False)
        return model

    # ------------------------------------------------------------------ server
    def aggregate(self, server_state, updates):
        """The chosen aggregation, run once per set of clients that sent the same tensors: a
        modality's modules are aggregated over the clients holding that modality only (weights
        renormalised over them), the LLM LoRA over every client; a tensor no client sent keeps
        its global value. With every client sending everything this is one plain call."""
        groups = upload_groups(updates)
        if len(groups) <= 1:
            return self.aggregator.aggregate(server_state, updates)
        new_global = dict(server_state['global'])
        results = []
        for members, names in groups:
            part = [replace(u, shared={n: u.shared[n] for n in names})
                    for u in updates if u.client_id in members]
            if any(is_lora_factor(n) for n in names):
                state = self.aggregator.aggregate(server_state, part)
                results.append(state)
                merged = state['global']
            else:   # no LoRA layer (e.g. only P_m): every aggregation averages such tensors
                merged = weighted_average([u.shared for u in part], weights_of(part))
            new_global.update({n: merged[n] for n in names})
        return {**merge_states(server_state, results), 'global': new_global}

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
        encoder.steps = encoder_steps(self.hparams.tau, num_steps)
        llm.steps = num_steps - encoder.steps
        return [encoder, llm] if schedule == 'two_stage' else [llm, encoder]
