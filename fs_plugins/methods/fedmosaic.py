"""FedMosaic (paper: ../shared/seeds/001_51e0ffdb9410dd34.txt): personalised federated
fine-tuning across heterogeneous client models with PQ-LoRA and RELA.

Model (§4.2, `fs_plugins.tuners.mosaic`): PQ-LoRA h = W0 x + B(P A x + Q) (Eq. 5; no alpha/r
unless pq_scale) on the target modules of the last layer of each of N_B blocks (Eq. 6 /
Algorithm 2), conventional LoRA (peft's alpha/r) on the other layers. Every module has a local
part (trains) and a frozen global one from the server, mixed by a learnable gate:
h = W0 x + (1 − σ(β)) h_local + σ(β) h_global (Eq. 7, β init 0), one β per decoder layer
(`gate`). PQ-LoRA's A, B are orthonormal and frozen; only P (init I) and Q train.
Alignment (§4.2.2, Algorithms 3-4, A.17, `tuners.mosaic.alignment`): before training, a model
type other than the pivot aligns its PQ A, B to the pivot's on public data, once (cached on
disk); by default one epoch of batch-4 Adam at 5e-5 with a cosine schedule (A.17).
The pivot and RELA's W_s are one model: `pivot_builder` / `pivot_model_type`, by default the
run's own model (the YAML's, before --client_cfg), which should be the smallest (A.3).

RELA (§4.1, Algorithm 1, `tuners.mosaic.rela`): every f steps a client takes the gradient of
the frozen W_s's last decoder layer's MLP down projection (`gradient_layer`) on its batch,
masks it with the shared mask and noises it (Eq. 3), folds the round's mean into an EMA with
ratio a (Algorithm 1 and the authors' code, where a = 0.5 was tuned: per round) and uploads
that with its local modules (`sanitise_order: equations`: Eqs. 2-3's reading instead, the EMA
at every gradient, sanitised once per upload). The
server keeps every client's latest upload, weights w_ij = softmax_j(cos(g̃_i, g̃_j)/τ) (Eq. 4)
and sends client i its customised global G_i = Σ_j w_ij L_j: P, Q over all clients (paired by
block and module path, 'pq/<block>.<module>/P|Q'), conventional LoRA and any other trained
tensor only over clients of i's model type (`aggregation.mosaic.customised_globals`).
Local modules' gates never leave the client. `rela: False` / `pq_lora: False` are the
paper's ablations (Table 7); `rela_model: training` (Table 30), a W_s other than the pivot and
a k-bit W_s (`small_builder`, `small_model_type`, `small_quantization`, Table 31) and
`align_a` / `align_b` (Table 32) the appendix's. A W_s with another tokenizer (Table 31's
LLaVA-Qwen-0.5B for Llama clients) reads the same records as the client's batch, encoded by
its own codec (`tuners.mosaic.ws_batches`; ours, the paper does not say how). `aggregation:
nbs` replaces RELA's weights by Nash-MTL's bargaining weights over the PQ-LoRA task vectors
(Table 33, A.22; `aggregation.nash`): one global for all clients.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from statistics import mean

import torch

from fs_plugins.aggregation.mosaic import customised_globals, kept_coordinates, rela_weights, uniform_weights
from fs_plugins.aggregation.nash import nash_weights
from fs_plugins.core.errors import ConfigError
from fs_plugins.core.seeding import derive_seed
from fs_plugins.data.federated import split_records
from fs_plugins.methods.base import Contract, Method, PaperClaim, differing_client_keys
from fs_plugins.methods.building import build_model
from fs_plugins.methods.registry import register_method
from fs_plugins.methods.specs import model_spec, split_spec
from fs_plugins.models.builders import load_base, sizing_architecture_only
from fs_plugins.schema import option
from fs_plugins.schema.options import Cfg, to_plain
from fs_plugins.tuners.mosaic.alignment import Pivot, align_to_pivot
from fs_plugins.tuners.mosaic.layer import GATE_ATTR, MOSAIC_ATTR, MosaicLinear
from fs_plugins.tuners.mosaic.model import decoder_layer_name, inject_mosaic
from fs_plugins.tuners.mosaic.rela import (
    RelaGradients,
    frozen_base_gradient,
    gradient_weight,
    is_adapter_parameter,
    labelled_tokens,
    last_block_pq_gradient,
    last_block_pq_layers,
    quantise_linear_weights,
    rela_gradient,
    rela_state_bytes,
)
from fs_plugins.tuners.mosaic.ws_batches import RecordIndex, encode_for

logger = logging.getLogger(__name__)

GRAD_KEY = 'fedmosaic.grad'     # the client's sanitised EMA of W_s last-layer gradients
ARCH_KEY = 'fedmosaic.arch'     # id of the client's model type (builder + model.type)
PIVOT_KEY = 'fedmosaic.pivot'   # id of the pivot, W_s and RELA source the client used
PQ_PREFIX = 'pq/'               # 'pq/<block>.<module>/P|Q': PQ-LoRA tensors across model types
GATE_NAMES = (f'.{MOSAIC_ATTR}.beta', f'.{GATE_ATTR}.beta')   # per module, per decoder layer
ALIGNMENT_DIR_NAME = 'fedmosaic_alignment'


@dataclass
class FedMosaicConfig:
    num_blocks: int = option(4, 'N_B: PQ-LoRA on the last layer of each of N_B blocks of the '
                                'language model (§4.2.1; paper: 4); at most the depth of every '
                                "client's model", ge=1)
    placement: str = option('equation', 'block ends: equation = I_k = k·⌊L/N_B⌋, I_{N_B} = L '
                                        '(Eq. 6); algorithm = n·⌊L/N_B⌋ + L mod N_B '
                                        '(Algorithm 2); they differ when N_B does not divide L',
                            choices=('equation', 'algorithm'))
    q_init_std: float = option(0.0, 'initial Q ~ N(0, std²) (the paper does not say; 0: Q = 0, '
                                    'so P = I, Q = 0 starts from B A x)', ge=0)
    gradient_every: int = option(10, 'f: RELA takes the W_s gradient every f local steps '
                                     '(Algorithm 1; §A.7: 10)', ge=1)
    gradient_layer: str = option('last_down_proj', "the W_s weight RELA's gradient is of (§4.1 "
                                 '"last-layer gradient"): last_down_proj = the last decoder '
                                 "layer's MLP down projection (hidden × intermediate; the authors' "
                                 'code, and the size A.9\'s 8.6 % / 3.4 % fit); lm_head = the '
                                 'output layer (vocab × hidden)',
                                 choices=('last_down_proj', 'lm_head'))
    sanitise_order: str = option('algorithm', 'equations = Eqs. 2-3 (Fig. 2): the EMA ĝ of every '
                                 'raw gradient, then g̃ = M ⊙ (ĝ + μ·ε) once per upload; '
                                 "algorithm = Algorithm 1 (and the authors' code): each gradient "
                                 "masked and noised, the round's mean folded into the EMA",
                                 choices=('equations', 'algorithm'))
    ema_ratio: float = option(0.5, 'a: ĝ ← (1 − a)·ĝ + a·g, per gradient (Eq. 2) or per round '
                                   'mean (Algorithm 1), see sanitise_order (§A.7: 0.5)', ge=0, le=1)
    noise_std: float = option(1e-4, 'μ: Gaussian noise std added to the gradient (Eq. 3; §A.7: '
                                    '1e-4)', ge=0)
    gradient_keep: float = option(0.4, 'N_s: fraction of the gradient coordinates kept by the '
                                       'mask all clients share (Eq. 3; §A.7: 40%, "60% gradient '
                                       'compression", A.8); each client uploads N_s · numel of '
                                       'the gradient layer floats', gt=0, le=1)
    rela: bool = option(True, 'RELA (§4.1); False = equal weights w_ij = 1/N (the ablation of '
                              "Table 7 '(+) PQ-LoRA' and Table 30 'Equal-weight aggregation'): "
                              'no W_s gradient is taken or sent')
    pq_lora: bool = option(True, 'PQ-LoRA at the block ends (§4.2); False = conventional LoRA on '
                                 "every layer, nothing shared across model types (Table 7 'Vanilla' "
                                 'with rela: False); no alignment')
    pq_scale: str = option('none', "PQ-LoRA's output scale: none = B(P A x + Q) as Eq. 5; "
                                   "alpha_over_r = times peft's lora alpha / r, as the authors' "
                                   'code (conventional LoRA always keeps alpha / r)',
                           choices=('none', 'alpha_over_r'))
    gate: str = option('per_layer', 'the gate β of Eq. 7: per_layer = one β per decoder layer, '
                                    'shared by its modules (§4.2.2 "at the l-th layer", '
                                    'Algorithm 1 "for each layer"); per_module = one per LoRA '
                                    "module (the authors' code gates per module, input-dependent)",
                       choices=('per_layer', 'per_module'))
    temperature: float = option(0.5, 'τ of w_ij = softmax_j(cos(g̃_i, g̃_j)/τ) (Eq. 4; §A.7: 0.5)',
                                gt=0)
    aggregation: str = option('rela', "how the server mixes the clients' local modules: rela = "
                                      "RELA's customised G_i per client (§4.1, the paper's); nbs = "
                                      "Nash-MTL's bargaining weights (Navon et al., 2022; Table 33 "
                                      "'FedMosaic w/ NBS', A.22: applied to adapter parameters): "
                                      'α with (M α)_i = 1/α_i, M = G Gᵀ of the task vectors g_i = '
                                      "client i's PQ-LoRA P, Q minus their initial values (the "
                                      'shared part), M scaled to unit Frobenius norm as the '
                                      "authors' code does; then w = α / Σ α (ours: FL averages "
                                      'parameters, and the raw Σ α_i g_i has norm ~√K whatever the '
                                      'updates\' scale), one global G = Σ_i w_i L_i for every client '
                                      '(conventional LoRA: w renormalised over its model type). No '
                                      'W_s gradient is taken; include_self does not apply',
                            choices=('rela', 'nbs'))
    include_self: bool = option(True, "whether client i's own module is in its G_i (Eq. 4 sums "
                                      'over all j; the public reference code masks j = i)')
    pivot_builder: str = option('', 'builder of the pivot model (alignment) and of W_s (RELA); '
                                    "'' = the run's fsplug.model.builder (set it in every process "
                                    'of a distributed run)')
    pivot_model_type: str = option('', "model.type of the pivot / W_s; '' = the run's model.type. "
                                       'Paper A.3: the smallest client model')
    rela_model: str = option('small', "the model RELA's gradients come from: small = the "
                                      'frozen pre-trained W_s (§4.1); training = the '
                                      "client's training model on the current batch (Table 30 "
                                      "'Training model gradients', with ema_ratio: 1.0): the "
                                      "gradients of its last block's PQ-LoRA P, Q, the last "
                                      "layer's weights whose size and meaning every model type "
                                      'shares', choices=('small', 'training'))
    small_builder: str = option('', "builder of RELA's W_s when it is not the pivot (A.20, "
                                    "Table 31); '' = pivot_builder")
    small_model_type: str = option('', "model.type of RELA's W_s when it is not the pivot "
                                       "(Table 31: LLaVA-Qwen-0.5B); '' = pivot_model_type. With "
                                       "another tokenizer than a client's, W_s reads the same "
                                       "records of each batch encoded by its own codec (ours)")
    small_quantization: str = option('none', "W_s's weights k-bit (A.20, Table 31: 8 / 4 bit): "
                                             'every linear layer but the output layer quantised '
                                             'and dequantised as bitsandbytes stores it (8bit: '
                                             'row-wise absmax int8; 4bit: NF4 in blocks of 64), '
                                             'simulated on any device', choices=('none', '8bit', '4bit'))
    small_shares_base: bool = option(True, "RELA's W_s is the client's own frozen base (its "
                                          'adapters switched off, eval mode) when they are the '
                                          'same model (builder, model.type, no k-bit weights) and '
                                          "only adapters train: no second copy (Table 15's memory). "
                                          'False: W_s is always its own frozen copy')
    align_a: bool = option(True, "fit a non-pivot model's PQ-LoRA A to the pivot's (L2, Eq. 20); "
                                 "False: A keeps its random orthonormal start (Table 32 'Random' A)")
    align_b: bool = option(True, "map a non-pivot model's PQ-LoRA B through CCA to the pivot's "
                                 "(§4.2.2); False: B keeps its random orthonormal start (Table 32 "
                                 "'Random' B)")
    local_only: bool = option(False, "SFT on FedMosaic's architecture (Table 29 'SFT (N_B)'): "
                                     'PQ-LoRA at the N_B block ends, conventional LoRA '
                                     'elsewhere, trained locally; no gate, no global module, '
                                     'nothing sent or received, no RELA, no alignment')
    pq_lr: float = option(0.0, "learning rate of the PQ-LoRA layers' trained tensors (P, Q and "
                               'the gates of their decoder layers); 0 = train.optimizer.lr. Paper '
                               '(A.7): 5e-5 for PQ-LoRA, 2e-5 for the other parameters '
                               '(train.optimizer.lr)', ge=0)
    alignment: str = option('compute', 'compute: align a non-pivot model on first use and cache '
                                       'it; require: fail unless the alignment is cached',
                            choices=('compute', 'require'))
    alignment_dir: str = option('', "where alignments are cached; '' = <fs_plugins cache>/"
                                    f'{ALIGNMENT_DIR_NAME} (FSPLUG_CACHE, else ~/.cache/fs_plugins)')
    alignment_data: str = option('held_out', 'public data D_p for the alignment: a .json/.jsonl '
                                             'record file, a builtin dataset name (its train '
                                             "records), 'held_out' (alignment_samples training "
                                             "records of the run's data held apart from every "
                                             "client: fsplug.data.public_holdout) or 'clients' "
                                             "(the clients' own training records, explicitly)")
    alignment_samples: int = option(64, 'public records used for the alignment', ge=2)
    alignment_reg: float = option(0.5, 'λ of the orthonormality term λ‖A Aᵀ − I‖² (Eq. 20; §A.7: '
                                       '0.5)', ge=0)
    alignment_schedule: str = option('paper', "how A is fitted to the pivot (Eq. 20): paper = one "
                                     'epoch over the public records, one Adam step per batch of '
                                     'alignment_batch_size at alignment_lr, cosine schedule '
                                     '(A.17); full_batch = alignment_steps Adam steps at '
                                     'alignment_full_batch_lr on all records at once',
                                     choices=('paper', 'full_batch'))
    alignment_batch_size: int = option(4, 'public records per alignment batch (A.17: 4)', ge=1)
    alignment_lr: float = option(5e-5, "peak Adam learning rate of the paper schedule (A.17: "
                                       '5e-5, cosine decay)', gt=0)
    alignment_steps: int = option(200, 'full_batch schedule: Adam steps fitting each A to the '
                                       'pivot (the paper does not use it)', ge=0)
    alignment_full_batch_lr: float = option(0.01, 'full_batch schedule: learning rate of those '
                                                  'Adam steps', gt=0)

def model_type_id(builder: str, model_type: str) -> int:
    """A stable positive int64 naming a model type (sent as a tensor)."""
    text = f'{builder}|{str(model_type).rsplit("@", 1)[0]}'
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], 'little')


def is_pq_name(name: str) -> bool:
    return name.startswith(PQ_PREFIX)


_PIVOTS: dict = {}         # pivot config -> alignment.Pivot, one per process
_SMALL_BASES: dict = {}    # (builder, model.type, dtype, k-bit) -> W_s, one frozen copy per process


def small_base(small_cfg, hparams):
    """W_s's LoadedBase (model in eval mode, k-bit weights where `small_quantization` says,
    and its codec), loaded once per process."""
    key = (small_cfg.fsplug.model.builder, small_cfg.model.type, small_cfg.fsplug.model.dtype,
           hparams.small_quantization)
    if key not in _SMALL_BASES:
        base = load_base(model_spec(small_cfg))
        quantise_linear_weights(base.model, hparams.small_quantization)
        base.model.eval()
        _SMALL_BASES[key] = base
    return _SMALL_BASES[key]


@register_method
class FedMosaic(Method):
    name = 'fedmosaic'
    robust_aggregation_refusal = 'its customised globals weigh clients by gradient similarity (RELA)'
    summary = ('FedMosaic: PQ-LoRA (shared P, Q on frozen aligned orthonormal A, B) at block ends '
               '+ gated local/global LoRA, heterogeneous models; RELA: per-client global '
               'G_i = Σ_j softmax(cos(g̃_i, g̃_j)/τ) L_j from sanitised W_s gradients')
    sent = ('LoRA, P, Q + sanitised W_s gradient EMA / customised global LoRA, P, Q '
            '(P, Q across model types; LoRA within one)')
    config_class = FedMosaicConfig
    client_codec = None   # the client's codec (after_build)
    # the client's training records by their encoding, built when a W_s of another tokenizer
    # first needs its own batch (derived from the config: a cache, not checkpointed state)
    record_index: RecordIndex | None = None
    # whether W_s reads the client's batches as they are (same_tokenizer), compared once: the
    # vocabularies are 100k+ entries and RELA asks on every gradient step
    ws_reads_client_batches: bool | None = None
    # Table 15's 1.098 (W_s's gradient, gates) is printed beside ours; matched compute uses ours,
    # measured over RELA's interval (cost_period), which depends on W_s's size
    relative_cost = None
    paper_relative_cost = 1.098
    hf_export_refusal = ("FedMosaic's layers mix a local and a global module with a learned "
                         "gate, and PQ-LoRA's P, Q sit between A and B: not a peft LoRA")
    contract = Contract(
        uploads=(f'{PQ_PREFIX}*',),
        stays_local=tuple(f'*{name}' for name in GATE_NAMES),
        extra=(GRAD_KEY, ARCH_KEY, PIVOT_KEY),
        depth_options=('num_blocks',),
        claim=PaperClaim(
            source=('A.9: "adding 8.6% overhead compared to sending only local LoRA parameters '
                    '... With N_s = 40%, the communication overhead drops to 3.4%" and "transmits '
                    'only P and Q, significantly reducing 14.3% communication cost ... FedMosaic '
                    'consequently achieves 10.9% lower communication cost than even the most '
                    'efficient baseline (i.e., FedAvg)": 1 − 0.143 + 0.034 = 0.891 of FedAvg-'
                    "LoRA's per-client upload. The figures fit a LLaVA-Llama3.2-3B client (28 "
                    'layers; r = 128 on all 7 linear modules, A.6; N_B = 4, so 4/28 = 14.3% of '
                    "its LoRA becomes P, Q) with W_s = Llama3.2-1B's last down_proj (2048 × 8192 = "
                    "8.6% of the 3B's LoRA); computed exactly (P, Q counted) 0.894; a 1B client "
                    '0.83 (docs/fedmosaic.md)'),
            up_ratio=0.891,
            memory_ratio=1.053,
            memory_source=('A.8, Table 15: "Relative M to SFT (Bytes)" 1.053 for FedMosaic '
                           '(overhead type PQ-LoRA); "the dual adapter only consumes about 5% '
                           'additional memory cost compared to using a single LoRA adapter"')))

    # ------------------------------------------------------------------ config
    @classmethod
    def resolve_config(cls, cfg) -> None:
        node = cfg.fsplug.fedmosaic
        if not node.pivot_builder:
            node.pivot_builder = cfg.fsplug.model.builder
        if not node.pivot_model_type:
            node.pivot_model_type = cfg.model.type
        if not node.small_builder:
            node.small_builder = node.pivot_builder
        if not node.small_model_type:
            node.small_model_type = node.pivot_model_type

    @classmethod
    def config_problems(cls, hparams, cfg):
        model = cfg['fsplug']['model']
        problems = []
        if model['adapter'] != 'lora':
            problems.append(f"fsplug.model.adapter = {model['adapter']!r}: fsplug.method = "
                            f"'fedmosaic' builds PQ-LoRA on peft's LoRA; use 'lora'")
        if cfg['fsplug']['aggregation']['per_architecture']:
            problems.append('fsplug.aggregation.per_architecture: FedMosaic shares P, Q across '
                            'architectures itself (RELA); turn it off')
        if hparams.rela and hparams.rela_model == 'training' and not hparams.pq_lora:
            problems.append("fsplug.fedmosaic.rela_model = 'training' takes the gradients of the "
                            "last block's PQ-LoRA P, Q: it needs fsplug.fedmosaic.pq_lora: True")
        if hparams.aggregation == 'nbs' and not (hparams.rela and hparams.pq_lora):
            problems.append("fsplug.fedmosaic.aggregation = 'nbs' replaces RELA's weights by Nash "
                            "bargaining over the PQ-LoRA updates: it needs fsplug.fedmosaic.rela: "
                            "True and pq_lora: True")
        if hparams.small_quantization != 'none' and model['quantization'] != 'none':
            problems.append(f"fsplug.fedmosaic.small_quantization = "
                            f"{hparams.small_quantization!r}: W_s is already loaded with "
                            f"fsplug.model.quantization = {model['quantization']!r}; set one")
        if model['vision']['tower_lora_targets']:
            problems.append("fsplug.model.vision.tower_lora_targets: FedMosaic places PQ-LoRA "
                            "by decoder layer of the language model; leave the vision tower "
                            "without LoRA")
        return problems

    @classmethod
    def client_problems(cls, run_cfg, client_cfg) -> list[str]:
        """P (r × r), Q (r) and the block pairing are shared by every client: a client may
        change its model, not r, the LoRA targets or the FedMosaic settings."""
        return differing_client_keys(
            run_cfg, client_cfg, (('fsplug', 'model', 'lora', 'r'),
                                  ('fsplug', 'model', 'lora', 'target_modules'), ('fsplug', 'fedmosaic')),
            'FedMosaic shares P, Q and their block pairing across all clients, so it must be the '
            'same for every client')

    def pivot_config(self, cfg):
        plain = to_plain(cfg)
        plain['fsplug']['model']['builder'] = self.hparams.pivot_builder or plain['fsplug']['model']['builder']
        plain['model']['type'] = self.hparams.pivot_model_type or plain['model']['type']
        return Cfg.wrap(plain)

    def small_config(self, cfg):
        """The config W_s is loaded from: the pivot's, with `small_builder` / `small_model_type`."""
        small = self.pivot_config(cfg)
        small.fsplug.model.builder = self.hparams.small_builder or small.fsplug.model.builder
        small.model.type = self.hparams.small_model_type or small.model.type
        return small

    def _type_ids(self, cfg) -> tuple[int, int]:
        """(own model type, the run's shared setup: pivot, W_s and its quantisation, RELA's
        source); the server refuses clients that differ in the second."""
        pivot, small, hp = self.pivot_config(cfg), self.small_config(cfg), self.hparams
        setup = model_type_id(pivot.fsplug.model.builder, pivot.model.type)
        if (small.fsplug.model.builder, small.model.type) != (pivot.fsplug.model.builder,
                                                                pivot.model.type) \
                or hp.small_quantization != 'none' or hp.rela_model != 'small':
            setup = model_type_id(f'{setup}|{small.fsplug.model.builder}|{small.model.type}|'
                                  f'{hp.small_quantization}|{hp.rela_model}', '')
        return model_type_id(cfg.fsplug.model.builder, cfg.model.type), setup

    def uses_small_model(self) -> bool:
        return self.takes_rela_gradient() and self.hparams.rela_model == 'small'

    def takes_rela_gradient(self) -> bool:
        hp = self.hparams
        return hp.rela and not hp.local_only and hp.aggregation == 'rela'

    def is_pivot(self, cfg) -> bool:
        pivot = self.pivot_config(cfg)
        return (model_type_id(cfg.fsplug.model.builder, cfg.model.type)
                == model_type_id(pivot.fsplug.model.builder, pivot.model.type))

    # ------------------------------------------------------------------- model
    def adapt_model(self, model, cfg):
        hp = self.hparams
        try:
            model.fedmosaic_pq = inject_mosaic(model, hp.num_blocks, hp.placement, hp.q_init_std,
                                               derive_seed(cfg.seed, 'fedmosaic-init'),
                                               gate=hp.gate, pq_scale=hp.pq_scale,
                                               pq_lora=hp.pq_lora, local_only=hp.local_only)
        except ValueError as exc:
            raise ConfigError(f"fsplug.fedmosaic.num_blocks = {hp.num_blocks} does not fit "
                              f"model.type '{cfg.model.type}': {exc}") from None
        if hp.pq_lora and not model.fedmosaic_pq:
            raise ConfigError(f"FedMosaic: no PQ-LoRA layer on model.type '{cfg.model.type}' "
                              f"(fsplug.model.lora.target_modules "
                              f"{list(cfg.fsplug.model.lora.target_modules)} in no block-end "
                              f"decoder layer)")
        return model

    def after_build(self, model, codec, cfg) -> None:
        """A non-pivot model aligns its PQ-LoRA A, B to the pivot's (cached). A model built for
        `fs-plugins estimate` (meta device, or random weights for its activation probe) is not
        aligned: alignment changes values, not shapes."""
        if next(model.parameters()).is_meta or sizing_architecture_only():
            return
        self.client_codec = codec   # RELA traces its batches back to records with it
        hp = self.hparams
        if (self.is_pivot(cfg) or not hp.pq_lora or hp.local_only
                or not (hp.align_a or hp.align_b)):
            return
        pivot_cfg = self.pivot_config(cfg)
        pivot = self.pivot_of(pivot_cfg)
        try:
            align_to_pivot(model, codec, model_spec(cfg), pivot, str(pivot_cfg.model.type), self.hparams,
                           split_spec(cfg))
        finally:
            pivot.release()   # its model is needed again only for a new alignment

    def pivot_of(self, pivot_cfg):
        """The pivot's digest, factors and codec, built once per process and pivot config
        (the clients of one model type need them all, its model only to compute)."""
        key = json.dumps(to_plain(pivot_cfg), sort_keys=True, default=str)
        if key not in _PIVOTS:
            def build():
                return build_model(pivot_cfg, type(self)(pivot_cfg), share_frozen=False)
            _PIVOTS[key] = Pivot.of(build(), build)
        return _PIVOTS[key]

    # ------------------------------------------------------------------ client
    def init_client_state(self, model, cfg):
        hp = self.hparams
        rela = RelaGradients(hp.gradient_every, hp.gradient_keep, hp.noise_std, hp.ema_ratio,
                             mask_seed=derive_seed(cfg.seed, 'fedmosaic-mask'),
                             noise_seed=derive_seed(cfg.seed, 'fedmosaic-noise', self.client_id),
                             order=hp.sanitise_order)
        return {'rela': rela, 'small_cfg': self.small_config(cfg), 'type_ids': self._type_ids(cfg),
                'ws_own_base': self.ws_is_own_base(model, cfg)}

    def ws_is_own_base(self, model, cfg) -> bool:
        """Whether RELA's W_s is this client's own frozen base (small_shares_base): the same
        builder and model.type, full-precision weights on both sides, and nothing trained but
        adapters (peft's disable_adapter then gives the pre-trained model)."""
        hp, small = self.hparams, self.small_config(cfg)
        same_model = (model_type_id(cfg.fsplug.model.builder, cfg.model.type)
                      == model_type_id(small.fsplug.model.builder, small.model.type))
        only_adapters = all(is_adapter_parameter(n) for n, p in model.named_parameters()
                            if p.requires_grad)
        return (hp.small_shares_base and same_model and only_adapters and hp.small_quantization == 'none'
                and cfg.fsplug.model.quantization == 'none' and hasattr(model, 'disable_adapter'))

    def small_model(self, state, device):
        """W_s on `device`: the frozen pre-trained model (k-bit where small_quantization says),
        loaded once per process."""
        return small_base(state['small_cfg'], self.hparams).model.to(device)

    def small_batch(self, batch, state):
        """The batch W_s reads: the client's own when they share a tokenizer; else the same
        records encoded by W_s's codec (A.20, `tuners.mosaic.ws_batches`), None if none fits."""
        small_codec = small_base(state['small_cfg'], self.hparams).codec
        if self.ws_reads_client_batches is None:
            self.ws_reads_client_batches = same_tokenizer(self.client_codec, small_codec)
        if self.ws_reads_client_batches:
            return batch
        if self.record_index is None:
            self.record_index = RecordIndex(client_train_records(self.cfg, self.client_id),
                                            self.client_codec, f'FedMosaic RELA, client {self.client_id}')
        own = encode_for(small_codec, self.record_index.records_of(batch))
        return None if own is None else {k: v.to(batch['input_ids'].device) for k, v in own.items()}

    def loss(self, model, batch, state):
        rela = state['rela']
        if self.uses_small_model() and rela.due() and state['ws_own_base']:
            rela.record(frozen_base_gradient(model, batch, self.hparams.gradient_layer),
                        labelled_tokens(batch))
        elif self.uses_small_model() and rela.due():   # W_s is a model of its own
            small_batch = self.small_batch(batch, state)
            if small_batch is not None:
                small = self.small_model(state, batch['input_ids'].device)
                rela.record(rela_gradient(small, small_batch, self.hparams.gradient_layer),
                            labelled_tokens(small_batch))
        return model(**batch).loss

    def before_optimizer_step(self, model, state):
        """rela_model = training: the step's gradients of the last block's P, Q (Table 30)."""
        rela = state['rela']
        if self.takes_rela_gradient() and self.hparams.rela_model == 'training' and rela.due():
            rela.record(last_block_pq_gradient(model, model.fedmosaic_pq))

    def after_step(self, model, state):
        state['rela'].end_step()

    def learning_rates(self, model, trainable_names):
        if not self.hparams.pq_lr:
            return {}
        # P, Q and the gates of PQ-LoRA modules, and the per-layer gates of block-end layers
        prefixes = tuple({f'{path}.{MOSAIC_ATTR}.' for path in model.fedmosaic_pq}
                         | {f'{decoder_layer_name(path)}.{GATE_ATTR}.' for path in model.fedmosaic_pq})
        return {n: self.hparams.pq_lr for n in trainable_names if n.startswith(prefixes)}

    def is_shared(self, name: str) -> bool:
        return not self.hparams.local_only

    def shared_tensors(self, model, trainable_names):
        """Conventional LoRA (and other trained tensors) under their names; P, Q of PQ-LoRA
        under 'pq/<block>.<module>/P|Q'; the gates β stay local (local_only: nothing)."""
        if self.hparams.local_only:
            return {}
        trainable = set(trainable_names)
        pq = model.fedmosaic_pq
        out = {}
        for name, param in model.named_parameters():
            if name not in trainable or name.endswith(GATE_NAMES):
                continue
            module, _, leaf = name.rpartition('.')
            if module.endswith(f'.{MOSAIC_ATTR}') and leaf in ('P', 'Q'):
                name = f'{PQ_PREFIX}{pq[module[:-len(MOSAIC_ATTR) - 1]]}/{leaf}'
            value = param.detach()
            out[name] = value if value.is_meta else value.to('cpu').clone()   # meta: estimate's shapes
        return out

    def extra_payload_shapes(self, model, cfg):
        """The model-type ids, and RELA's sanitised gradient: N_s of W_s's chosen weight."""
        shapes = {ARCH_KEY: ((), torch.int64), PIVOT_KEY: ((), torch.int64)}
        if self.takes_rela_gradient():
            numel, _ = self.rela_gradient_source(model, cfg)
            shapes[GRAD_KEY] = (kept_coordinates(numel, self.hparams.gradient_keep),)
        return shapes

    def rela_gradient_source(self, model, cfg) -> tuple[int, torch.nn.Module | None]:
        """(entries of the gradient RELA takes, W_s's own copy or None): the last block's P, Q
        (rela_model 'training'), W_s's chosen weight on the client's base (no copy), else on
        W_s loaded on its own (in the caller's `architecture_only` context, if any)."""
        if self.hparams.rela_model == 'training':
            r = int(cfg.fsplug.model.lora.r)
            return len(last_block_pq_layers(model.fedmosaic_pq)) * (r * r + r), None
        if self.ws_is_own_base(model, cfg):
            return gradient_weight(model, self.hparams.gradient_layer).numel(), None
        small = load_base(model_spec(self.small_config(cfg))).model
        return gradient_weight(small, self.hparams.gradient_layer).numel(), small

    def cost_period(self, cfg) -> int:
        """RELA takes W_s's gradient every gradient_every steps (the training model's costs no
        extra pass)."""
        return int(self.hparams.gradient_every) if self.uses_small_model() else 1

    def memory_terms(self, model, cfg):
        """W_s's own copy (when it is not this client's base: another model, k-bit, or
        small_shares_base False) and RELA's gradient state (mask, EMA, one step's gradient);
        the global modules are buffers, which the estimate counts for every method."""
        if not self.takes_rela_gradient():
            return {}
        hp, terms = self.hparams, {}
        numel, small = self.rela_gradient_source(model, cfg)
        if small is not None:
            terms['W_s copy (RELA)'] = sum(p.numel() * p.element_size() for p in small.parameters())
        kept = kept_coordinates(numel, hp.gradient_keep)
        terms['RELA gradient state'] = rela_state_bytes(hp.sanitise_order, numel, kept)
        return terms

    def client_extra(self, model, state):
        own, pivot = state['type_ids']
        extra = {ARCH_KEY: torch.tensor(own), PIVOT_KEY: torch.tensor(pivot)}
        if self.takes_rela_gradient():
            extra[GRAD_KEY] = state['rela'].end_round()
        return extra

    def client_metrics(self, model, state):
        """The mean gate σ(β) over the model's gates (each per-layer gate once)."""
        betas = {}
        for module in model.modules():
            if isinstance(module, MosaicLinear) and not module.mosaic.local_only:
                beta = module.mosaic.beta_parameter()
                betas[id(beta)] = beta
        gates = [float(torch.sigmoid(b.detach())) for b in betas.values()]
        return {'fedmosaic_gate': mean(gates)} if gates else {}

    @torch.no_grad()
    def receive(self, model, content, state):
        """G_i goes into the frozen global modules; any other trained tensor is loaded."""
        modules = dict(model.named_modules())
        by_key = {key: name for name, key in model.fedmosaic_pq.items()}
        params = dict(model.named_parameters())
        for name, value in content.items():
            if is_pq_name(name):
                key, leaf = name[len(PQ_PREFIX):].rsplit('/', 1)
                if key not in by_key:
                    raise KeyError(f"FedMosaic: received '{name}', but this model has no PQ-LoRA "
                                   f"layer {key} (its PQ layers: {sorted(by_key)})")
                target = getattr(modules[by_key[key]].mosaic, f'global_{leaf}')
            elif '.lora_A.' in name or '.lora_B.' in name:
                module = modules.get(name.split('.lora_')[0])
                if not isinstance(module, MosaicLinear) or module.mosaic.pq:
                    raise KeyError(f"FedMosaic: received '{name}', which is no conventional "
                                   f"LoRA layer of this model")
                target = getattr(module.mosaic, 'global_A' if '.lora_A.' in name else 'global_B')
            elif name in params:
                target = params[name]
            else:
                raise KeyError(f"FedMosaic: received '{name}', which this model does not have")
            if target.shape != value.shape:
                raise ValueError(f"FedMosaic: received '{name}' of shape {tuple(value.shape)}, "
                                 f"the model's is {tuple(target.shape)}")
            target.copy_(value.to(device=target.device, dtype=target.dtype))

    def artifact_extra(self, model, state):
        """The global modules (buffers) and PQ-LoRA's frozen, possibly aligned, A and B."""
        out = {n: b.detach().to('cpu').clone() for n, b in model.named_buffers()
               if f'.{MOSAIC_ATTR}.global_' in n}
        params = dict(model.named_parameters())
        for name in model.fedmosaic_pq:
            for part in ('lora_A', 'lora_B'):
                key = f'{name}.{part}.default.weight'
                out[key] = params[key].detach().to('cpu').clone()
        return out

    @torch.no_grad()
    def restore_artifact(self, model, extra):
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name, value in extra.items():
            if name not in tensors:
                raise KeyError(f"FedMosaic: saved tensor '{name}' has no place in the model")
            tensors[name].copy_(value.to(tensors[name].dtype))

    # ------------------------------------------------------------------ server
    def init_server_state(self, initial_shared):
        # no single global model: every client gets its own G_i (content_for)
        # 'initial': the starting P, Q (NBS's task vectors are the locals minus them)
        initial = {name: value.clone() for name, value in initial_shared.items() if is_pq_name(name)}
        return {'global': {}, 'locals': {}, 'grads': {}, 'archs': {}, 'pivots': {}, 'custom': {},
                'initial': initial}

    def aggregate(self, server_state, updates):
        state = {key: dict(value) if isinstance(value, dict) else value
                 for key, value in server_state.items()}
        rela = self.takes_rela_gradient()
        for update in updates:
            missing = [k for k in ((GRAD_KEY,) if rela else ()) + (ARCH_KEY, PIVOT_KEY)
                       if k not in update.extra or update.extra[k] is None]
            if missing:
                raise ValueError(f'FedMosaic: client {update.client_id} sent no {missing}')
            cid = update.client_id
            state['locals'][cid] = update.shared
            if rela:
                state['grads'][cid] = update.extra[GRAD_KEY].to(torch.float32)
            state['archs'][cid] = int(update.extra[ARCH_KEY])
            state['pivots'][cid] = int(update.extra[PIVOT_KEY])
        ids = sorted(state['locals'])
        check_consistent(ids, state)
        if self.hparams.aggregation == 'nbs':
            weights = nbs_weight_rows([state['locals'][c] for c in ids], state['initial'])
        elif rela:
            weights = rela_weights(torch.stack([state['grads'][c] for c in ids]),
                                   self.hparams.temperature, self.hparams.include_self)
        else:
            weights = uniform_weights(len(ids), self.hparams.include_self)
        logger.info('FedMosaic %s weights (rows: clients %s):\n%s', self.hparams.aggregation, ids,
                    '\n'.join(' '.join(f'{w:.3f}' for w in row) for row in weights.tolist()))
        custom = customised_globals([state['locals'][c] for c in ids], weights,
                                    [state['archs'][c] for c in ids], is_pq_name)
        state['custom'] = dict(zip(ids, custom))
        return state

    def content_for(self, server_state, client_id):
        return server_state['custom'].get(int(client_id), {})


def nbs_weight_rows(locals_: list[dict], initial: dict) -> torch.Tensor:
    """(N × N) weights whose every row is Nash-MTL's w = α / Σ α over the clients' PQ-LoRA task
    vectors (their P, Q minus the initial ones, flattened in name order)."""
    names = sorted(initial)
    if not names:
        raise ValueError("FedMosaic NBS: the server's initial model has no PQ-LoRA tensor")
    vectors = []
    for index, module in enumerate(locals_):
        missing = [n for n in names if n not in module]
        if missing:
            raise ValueError(f'FedMosaic NBS: upload {index} has no {missing[:3]}')
        vectors.append(torch.cat([(module[n].to(torch.float64) - initial[n].to(torch.float64)
                                   ).flatten() for n in names]))
    weights = nash_weights(torch.stack(vectors))
    return weights.expand(len(locals_), -1).clone()


def same_tokenizer(codec, small_codec) -> bool:
    """Whether W_s can read the client's batches as they are: one vocabulary, one codec kind
    (a multimodal W_s needs the pixels its own processor makes)."""
    return (type(codec) is type(small_codec)
            and codec.tokenizer.get_vocab() == small_codec.tokenizer.get_vocab())


_CLIENT_RECORDS: dict = {}   # split spec -> the run's FederatedRecords, one split per process


def client_train_records(cfg, client_id: int) -> list[dict]:
    """Client `client_id`'s training records, split as the runners split them
    (`data.federated.split_records` of the same spec)."""
    spec = split_spec(cfg)
    key = repr(spec)
    if key not in _CLIENT_RECORDS:
        _CLIENT_RECORDS[key] = split_records(spec)
    clients = _CLIENT_RECORDS[key].clients
    if client_id not in clients:
        raise ValueError(f'FedMosaic RELA: client {client_id} is not in the split of '
                         f'data.type {cfg.data.type!r} (clients {sorted(clients)})')
    return list(clients[client_id]['train'])


def check_consistent(ids, state) -> None:
    """Every client used the same pivot / W_s (same gradient size) and the same PQ shapes."""
    first = ids[0]
    for cid in ids[1:]:
        if state['pivots'][cid] != state['pivots'][first]:
            raise ValueError(f'FedMosaic: client {cid} aligned to another pivot / W_s than client '
                             f'{first}; set fsplug.fedmosaic.pivot_builder, pivot_model_type, '
                             f'small_builder, small_model_type, small_quantization and '
                             f'rela_model alike in every process')
        if cid in state['grads'] and state['grads'][cid].shape != state['grads'][first].shape:
            raise ValueError(f'FedMosaic: client {cid} sent a RELA gradient of shape '
                             f'{tuple(state["grads"][cid].shape)}, client {first} '
                             f'{tuple(state["grads"][first].shape)} (fsplug.fedmosaic.'
                             f'gradient_keep and gradient_layer must be the same everywhere)')
    shapes: dict[str, tuple[int, tuple]] = {}
    for cid in ids:
        for name, value in state['locals'][cid].items():
            if is_pq_name(name):
                seen = shapes.setdefault(name, (cid, tuple(value.shape)))
                if seen[1] != tuple(value.shape):
                    raise ValueError(f"FedMosaic: client {cid} sent {name} of shape "
                                     f"{tuple(value.shape)}, client {seen[0]} {seen[1]}: "
                                     f"fsplug.model.lora.r must be the same for every client")
