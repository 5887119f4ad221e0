"""The contract every method implements, for both runners.

A method answers four questions (docs/architecture.md, "The Method contract"):
1. its adapter: `adapt_model` changes the built model (plain LoRA is already injected by peft);
2. its client procedure: `phases` (which parameters train in which part of a round), `loss`,
   `after_step` (counters), all reading and writing the client's persistent `state`;
3. what leaves the client: `is_shared(name)` picks the shared trainable parameters,
   `client_extra` adds any other payload (counts, gradient sketches);
4. its server side: `init_server_state`, `aggregate` (a pure function of the updates and the
   previous state) and `content_for` (what one client receives: the same dict for everyone,
   or a personalised one).

Nothing here imports FederatedScope; the FS binding and the embedded runner both call it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.models.classifier import head_stays_local, is_task_head
from fs_plugins.schema.options import build, to_plain


@dataclass
class NoOptions:
    """The config class of a method without hyper-parameters."""


@dataclass
class Phase:
    """A contiguous block of local steps in which only some parameters train.

    `trainable(name)` selects among the model's adapter parameters; None means all of them.
    `adapters` names the peft adapters active in the forward pass during the phase (e.g.
    DITTO trains its global adapter alone, then its personal one alone); None leaves the
    model's active adapters as they are."""
    name: str
    steps: int
    trainable: Callable[[str], bool] | None = None
    adapters: tuple[str, ...] | None = None


@dataclass
class ClientUpdate:
    """What one client sends after local training."""
    client_id: int
    num_samples: int
    shared: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    dataset_size: int = 0             # n_k: the client's training records
    # p_k before normalisation, set by the server from fsplug.aggregation.weights
    # (server.aggregation_weight); None: num_samples
    weight: float | None = None


@dataclass(frozen=True)
class PaperClaim:
    """A paper's statement about a method's communication, checked by `fs-plugins audit` and
    printed by `fs-plugins estimate` beside the measured figure.

    `up_ratio`: the method's bytes uploaded per client per round over FedAvg-LoRA's on the same
    model and targets (None when the paper gives no ratio); `source`: where the paper says so
    (table, section) and in its words; `tolerance`: the relative difference the audit accepts.
    `memory_ratio`: the method's training memory over SFT's (`standalone`: one LoRA, one
    forward and backward) on the same model, as `memory_source` says; `fs-plugins estimate`
    prints its own ratio beside it."""
    source: str
    up_ratio: float | None = None
    tolerance: float = 0.10
    memory_ratio: float | None = None
    memory_source: str = ''


@dataclass(frozen=True)
class Contract:
    """What a method declares about its wiring, next to its options (checked by
    `fs_plugins.run.audit` on every shipped YAML).

    Patterns are fnmatch globs over parameter names (`*lora_A*`) or, for uploads, over the
    names the client sends (`pq/*`).
    - `trains`: trainable tensors that must receive a non-zero gradient in some phase of a round
      (empty: every trainable tensor must);
    - `uploads`: names that must be in every upload (empty: no requirement);
    - `stays_local`: trainable tensors that must never leave the client;
    - `unchanged_uploads`: uploaded tensors that may legitimately be unchanged by local training
      (e.g. a frozen tensor the method still sends);
    - `extra`: keys of the extra payload (gradient sketches, statistics) the method sends;
    - `claim`: the paper's communication claim, if it has one;
    - `audit_clients`: how many clients the audit needs at least (e.g. a clustering step);
    - `gated_trains`: trainable tensors that a server-chosen configuration may leave frozen for a
      whole audited round (FedAdapter's inactive layers): on a client whose phases never made
      one trainable, it needs no gradient and is not uploaded (`Method.expected_upload`);
    - `depth_options`: options under `fsplug.<name>` bounded by the model's depth, capped at a
      tiny model's when the audit swaps the YAML's model for one (FedMosaic's N_B);
    - `rank_options`: options bounded by the LoRA rank, capped with it by that swap (AdaLoRA's
      target_r);
    - `per_client_options`: lists with one entry per client, thinned evenly to the tiny
      federation's clients by that swap (DoFIT's domains)."""
    trains: tuple[str, ...] = ()
    uploads: tuple[str, ...] = ()
    stays_local: tuple[str, ...] = ()
    unchanged_uploads: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    claim: PaperClaim | None = None
    audit_clients: int = 2
    depth_options: tuple[str, ...] = ()
    rank_options: tuple[str, ...] = ()
    per_client_options: tuple[str, ...] = ()
    gated_trains: tuple[str, ...] = ()


def weights_of(updates) -> list[float]:
    """The clients' aggregation weights (unnormalised p_k) in the order of `updates`."""
    return [float(u.num_samples if u.weight is None else u.weight) for u in updates]


class Method:
    """Base class: FedAvg-style behaviour that subclasses override piece by piece."""

    name: ClassVar[str] = ''
    # one line each for the method table of docs/reference.md (scripts/gen_reference.py): what the method
    # does, and what travels each round ('up / down')
    summary: ClassVar[str] = ''
    sent: ClassVar[str] = ''
    # the typed, documented hyper-parameters under `fsplug.<name>` (a dataclass of
    # `fs_plugins.schema.option` fields, defaults from the paper); `self.hparams` is one
    config_class: ClassVar[type] = NoOptions
    # True when the method changes frozen base weights (then clients of one process must not
    # share them)
    modifies_frozen_weights: ClassVar[bool] = False
    # why a client's model cannot be exported as a plain Hugging Face model (merged or as one
    # peft adapter), e.g. forward hooks or modules of the method's own; '' when it can
    hf_export_refusal: ClassVar[str] = ''
    # why fsplug.aggregation.robust.average 'median' / 'trimmed_mean' cannot apply: the method's
    # aggregation of its shared tensors is not `weighted_average` (fs_plugins.aggregation.robust);
    # '' when it is
    robust_aggregation_refusal: ClassVar[str] = ''
    # the peft adapters active outside training (evaluation, saving, export) when phases
    # switch them; None: the adapters adapt_model left active
    inference_adapters: ClassVar[tuple[str, ...] | None] = None
    # False: the model gets no peft adapter from fsplug.model.lora (the method brings its own
    # trainable modules, e.g. the LoRA-reuse methods' routers over a frozen library)
    uses_peft_adapter: ClassVar[bool] = True
    # True: local steps only evaluate `loss` (no backward, no optimiser step), e.g. LoRAHub's
    # gradient-free search, where the loss scores candidates the server proposed
    gradient_free: ClassVar[bool] = False
    # False: nothing trains (zero_shot): the model may have no trainable tensor, a round has no
    # local step and no optimiser, and nothing is sent
    trains: ClassVar[bool] = True
    # FLOPs of the method's local round over SFT's (FedAvg-LoRA's) when every phase runs
    # train.local_update_steps, as a paper states it (FedMosaic Table 15, "relative C to SFT");
    # fsplug.train.local_compute 'matched' divides the round's steps by it. None: measured
    # (fs_plugins.run.flops) unless fsplug.train.relative_cost sets it
    relative_cost: ClassVar[float | None] = None
    # the ratio the paper states (FedMosaic's Table 15), printed beside the measured one where
    # this implementation's cost differs from what the paper costed (then relative_cost is None)
    paper_relative_cost: ClassVar[float | None] = None
    # what must train, what is uploaded, what stays on the client, and the paper's communication
    # claim (Contract; checked by `fs-plugins audit`)
    contract: ClassVar[Contract] = Contract()

    def __init__(self, cfg):
        self.cfg = cfg
        self.hparams = self.options(cfg)
        self.client_id: int | None = None   # set by the ClientProcedure that uses it
        self.round_idx = 0   # client side: the federation's round (0-based) being trained
        # client side: which micro-batch of the optimiser step `loss` sees (0 opens a step;
        # grad.grad_accum_count micro-batches make one step)
        self.micro_index = 0
        # server side: {client id: that client's config} where the runner knows them (for
        # methods that build a client's model on the server, e.g. PerAda's distillation)
        self.client_configs: dict = {}
        if keeps_head_local(cfg):   # a classifier's head trains but never leaves the client
            method_is_shared = self.is_shared
            self.is_shared = lambda name: not is_task_head(name) and method_is_shared(name)

    @classmethod
    def options(cls, cfg):
        """The method's typed hyper-parameters from a (validated) config."""
        return build(cls.config_class, to_plain(cfg['fsplug'].get(cls.name, {})))

    @classmethod
    def config_problems(cls, hparams, cfg) -> list[str]:
        """Rules between this method's hyper-parameters and the rest of the config (plain
        dicts, keys and types already checked); one line per problem, naming the key."""
        return []

    @classmethod
    def resolve_config(cls, cfg) -> None:
        """Fills keys of the run's config derived from other keys (e.g. a default that is
        another key's value), before any --client_cfg entry is merged on top."""

    @classmethod
    def resolve_client_config(cls, cfg, records: dict) -> None:
        """Fills keys of one client's config derived from its own records ({'train', 'test',
        ...}), after its --client_cfg entry is merged and before its model is built (e.g.
        UniFLoW's client_modalities 'auto': the modalities its training records hold)."""

    @classmethod
    def client_problems(cls, run_cfg: dict, client_cfg: dict) -> list[str]:
        """What a --client_cfg entry may not change for this method: one line per problem,
        naming the key (plain dicts: the run's config and the client's merged one)."""
        return []

    # ------------------------------------------------------------------ model
    def adapt_model(self, model: torch.nn.Module, cfg) -> torch.nn.Module:
        """Adds the method's own modules after LoRA injection; `cfg` is the client's config."""
        return model

    def after_build(self, model: torch.nn.Module, codec, cfg) -> None:
        """Work on the adapted model that needs its codec (e.g. FedMosaic's alignment on
        public data); runs before frozen tensors are shared between clients."""

    # ----------------------------------------------------------------- client
    def init_client_state(self, model: torch.nn.Module, cfg) -> dict:
        """Client-local state that persists across rounds (counters, control variates)."""
        return {}

    def learning_rates(self, model: torch.nn.Module, trainable_names) -> dict[str, float]:
        """Learning rates of trainable parameters that do not use train.optimizer.lr
        ({name: lr}; e.g. FedMosaic's PQ-LoRA); {} for none."""
        return {}

    def phases(self, num_steps: int, cfg) -> list[Phase]:
        return [Phase('train', num_steps)]

    def is_shared(self, name: str) -> bool:
        """Whether trainable parameter `name` leaves the client."""
        return True

    def shared_tensors(self, model: torch.nn.Module, trainable_names) -> dict[str, torch.Tensor]:
        """CPU copies of the trainable parameters that leave the client."""
        trainable = set(trainable_names)
        return {n: p.detach().to('cpu').clone() for n, p in model.named_parameters()
                if n in trainable and self.is_shared(n)}

    def loss(self, model: torch.nn.Module, batch: dict, state: dict) -> torch.Tensor:
        return model(**batch).loss

    def before_optimizer_step(self, model: torch.nn.Module, state: dict) -> None:
        """Called after backward, before gradient clipping and the optimiser step
        (e.g. to correct gradients with control variates)."""

    def after_step(self, model: torch.nn.Module, state: dict) -> None:
        """Called after every optimiser step (e.g. to accumulate activation counts)."""

    def client_extra(self, model: torch.nn.Module, state: dict) -> dict[str, torch.Tensor]:
        """Payload sent beside the shared parameters, computed at the end of a local round
        (it may update `state`, e.g. a control variate)."""
        return {}

    def extra_payload_shapes(self, model: torch.nn.Module, cfg) -> dict[str, tuple]:
        """The shapes of what `client_extra` sends per round, known before training (for
        `fs-plugins estimate`, which never trains): {key: shape} for a float32 tensor, or
        {key: (shape, dtype)} for another dtype; `model` is the adapted model (possibly on the
        meta device), `cfg` the client's config. Where the payload varies by round (e.g. only
        in a warm-up) give its largest round. Default: no extra payload."""
        return {}

    def cost_period(self, cfg) -> int:
        """Consecutive local steps over which the method's per-step work repeats (FedMosaic:
        RELA's W_s gradient every f steps): its measured relative cost counts that many steps
        of each phase, with `after_step` between them (which must then leave the model as it
        is), and averages them. Default 1."""
        return 1

    def memory_terms(self, model: torch.nn.Module, cfg) -> dict[str, int]:
        """Bytes a client holds while training beside the model's weights, buffers, trainable
        tensors, their gradients, the optimiser's state and the activations, by what they are
        (e.g. FedMosaic's W_s copy and RELA state), for `fs-plugins estimate`; `model` as in
        `extra_payload_shapes` (possibly on the meta device). Default: none."""
        return {}

    def client_metrics(self, model: torch.nn.Module, state: dict) -> dict[str, float]:
        """Scalars logged with the client's train row of the round (after `client_extra`),
        e.g. a summary of FLAME's activation frequencies."""
        return {}

    def receive(self, model: torch.nn.Module, content: dict[str, torch.Tensor],
                state: dict) -> None:
        """Applies what the server sent to this client (default: load shared tensors)."""
        load_tensors(model, content)

    def artifact_extra(self, model: torch.nn.Module, state: dict) -> dict[str, torch.Tensor]:
        """Tensors besides the trained parameters that the saved model needs to equal this
        client's model (fs_plugins.run.artifacts): changed frozen weights, settings the server
        assigned. Names must not be trained parameters' names. Default: none."""
        return {}

    def restore_artifact(self, model: torch.nn.Module, extra: dict[str, torch.Tensor]) -> None:
        """Applies `artifact_extra`'s tensors to a rebuilt model (default: parameters by name)."""
        load_tensors(model, extra)

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared: dict[str, torch.Tensor]) -> dict:
        """Server state kept across rounds; 'global' holds the shared parameters."""
        return {'global': dict(initial_shared)}

    def aggregate(self, server_state: dict, updates: list[ClientUpdate]) -> dict:
        """New server state from the previous one and this round's updates (FedAvg here)."""
        merged = weighted_average([u.shared for u in updates], weights_of(updates))
        return {**server_state, 'global': {**server_state['global'], **merged}}

    def content_for(self, server_state: dict, client_id: int) -> dict[str, torch.Tensor]:
        """What client `client_id` receives before training or evaluation."""
        return server_state['global']

    def expected_upload(self, signature: dict, sent: dict | None) -> dict:
        """The shared tensors a client must send this round ({name: signature entry}), given
        its full `signature` and what the server sent it (`sent`; None: not known), e.g.
        FedAdapter's active layers only. Default: the whole signature."""
        return signature

    def client_groups(self, client_ids) -> dict[str, list[int]]:
        """Named groups of clients whose mean the summary reports beside the overall one
        (e.g. FLAME's budget levels β1..βn); {} for none."""
        return {}


def keeps_head_local(cfg) -> bool:
    """fsplug.model.head 'local' on a classifier builder (models.classifier.head_stays_local):
    then every method's `is_shared` leaves the task head out, whatever the method shares."""
    try:
        model = cfg['fsplug']['model']
        builder, head = model['builder'], model.get('head', 'local')
    except (KeyError, TypeError):
        return False
    return head_stays_local(builder, head)


def differing_client_keys(run_cfg: dict, client_cfg: dict, paths, why: str) -> list[str]:
    """One problem line per key path (a tuple of keys) whose value in a client's config differs
    from the run's, ending with `why` (for `Method.client_problems`)."""
    problems = []
    for path in paths:
        run_value, client_value = run_cfg, client_cfg
        for key in path:
            run_value, client_value = run_value[key], client_value[key]
        if run_value != client_value:
            problems.append(f"{'.'.join(path)} = {client_value!r} differs from the run's "
                            f"{run_value!r}; {why}")
    return problems


def activate_adapters(model: torch.nn.Module, adapters) -> None:
    """Makes the peft adapters `adapters` the active ones in the forward pass, keeping every
    parameter's requires_grad (peft's set_adapter would change them)."""
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    model.base_model.set_adapter(list(adapters))
    for name, param in model.named_parameters():
        param.requires_grad_(flags[name])


def copy_adapter(model: torch.nn.Module, source: str, target: str) -> None:
    """Copies the values of peft adapter `source` into adapter `target` (same config)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if f'.{source}.' in name:
                params[name.replace(f'.{source}.', f'.{target}.')].copy_(param)


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """Σ ‖θ − anchor‖² over the model parameters named in `anchor`."""
    params = dict(model.named_parameters())
    return sum(((params[n] - a.to(params[n].device, params[n].dtype)) ** 2).sum()
               for n, a in anchor.items())


def load_tensors(model: torch.nn.Module, content: dict[str, torch.Tensor]) -> None:
    """Copies named tensors into the model's parameters in place; names must exist."""
    if not content:
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in content.items():
            if name not in params:
                raise KeyError(f"Received tensor '{name}' has no matching model parameter")
            target = params[name]
            if target.shape != value.shape:
                raise ValueError(f"Received tensor '{name}' has shape {tuple(value.shape)}, "
                                 f"the model's parameter has {tuple(target.shape)} (clients on "
                                 f"different models: set fsplug.aggregation.per_architecture: "
                                 f"True, or use a method for heterogeneous clients)")
            target.copy_(value.to(device=target.device, dtype=target.dtype))
