"""FedA²-LoRA (UniFLoW): per LoRA layer, A = Σ p_k A_k and B solves
min ‖B A − Σ p_k B_k A_k‖²_F + λ‖B‖²_F, i.e. B = U Aᵀ (A Aᵀ + λI)⁻¹, so the global product
B·A is the best (ridge) fit of the averaged updates in A's row space. Computed without forming
any d_out × d_in matrix (aggregation.lora.fed_a2). Clients of different LoRA ranks
(`--client_cfg` fsplug.model.lora.r) are zero-padded to the largest rank (appendix E.4,
Table 10) and each keeps the first r_k components of the global factors. Upload equals
FedAvg-LoRA's.

When λ applies (`ridge_mode`): the paper says it two ways. Eq. 13 and Algorithm 1 (lines
14-18) apply λ only when A Aᵀ is not invertible and solve B = U Aᵀ (A Aᵀ)⁻¹ exactly otherwise;
§3 ("in practice λ = 1") and Table 12 (λ = 0 "w/o Tik." vs λ = 0.1) read as λ every round.
The two differ a lot: at peft's initialisation A Aᵀ ≈ I/3 (kaiming-uniform rows of norm² ≈ 1/3),
so λ = 1 every round multiplies B by about 1/4 per round. `when_singular` (default: the
equations and the algorithm) adds λ = `ridge` only when cond(A Aᵀ) ≥ `singular_cond`
(aggregation.lora.FED_A2_SINGULAR_COND, 1e6: the one definition of "singular" for this method,
its VeRA path and the maths' lam=None fallback); `always` adds it every round (Table 12's
setting: `ridge_mode: always, ridge: 0.1`; `ridge: 0` its "w/o Tik." row). A layer whose
A Aᵀ counts as singular is logged at INFO level.

Two-stage schedule (§4, text around Table 4: "FedLoRA during the first 200 communication
rounds", then FedA²): `fedavg_rounds` N makes the first N aggregations plain FedAvg of A and
B (zero-padded averaging for mixed ranks, Table 10's "LoRA (zero-padding)"). The server
counts its aggregations in its state (`rounds`, as PerAda's kd_rounds does), so both runners
(embedded and FederatedScope) switch after the same round.

VeRA (`fsplug.model.adapter: vera`, Table 4's "FedA²-VeLoRA"): ΔW = diag(λ_b) B diag(λ_d) A
with A, B frozen and shared; λ_d (A's part) is averaged and λ_b (B's part) is the ridge fit
of Σ p_k ΔW_k, row by row (aggregation.lora.fed_a2_vera has the derivation), under the same
`ridge_mode` and `singular_cond` (applied to its diagonal Gram matrix diag(c_i G c_iᵀ)) but
with its own λ (`vera_ridge`, default null: 1e-6 × the mean of c_i G c_iᵀ; the paper gives
no λ for VeRA, and its λ = 1 is calibrated for LoRA's B: against VeRA's c_i G c_iᵀ ≈ 0.02 at
initialisation it would all but erase λ_b whenever it applies). The server needs
the frozen projections: it takes them from the global model it builds from the run's config
at start-up (`initial_global` calls `adapt_model`), since they are drawn from the run's seed
(peft's projection_prng_key) exactly as on every client; nothing extra is uploaded.
`client_problems` keeps every client on the run's adapter and on the keys that determine the
projections."""
import logging
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.lora import FED_A2_SINGULAR_COND, RIDGE_MODES, fed_a2, fed_a2_vera, hetlora_pad
from fs_plugins.aggregation.pairs import lora_pairs, vera_pairs
from fs_plugins.methods.base import Method, differing_client_keys, weights_of
from fs_plugins.methods.building import build_model
from fs_plugins.methods.lora_family import aggregate_by_layer, receive_at_own_rank
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

logger = logging.getLogger(__name__)

RIDGE_NULL_REFUSED = (
    "fsplug.fed_a2.ridge = null is no longer accepted: it meant Eq. 13's case split, which is "
    "now `ridge_mode: when_singular` (the default) with the singular branch's λ = ridge (default "
    "1.0, the paper's; null used 1e-6 × the mean eigenvalue of A Aᵀ there). Set a number "
    "(e.g. ridge: 1.0), and ridge_mode: always for λ every round (Table 12's setting)")

# what fixes VeRA's frozen projections (peft draws them from the seed, sized by the targeted
# layers): a client may not change these when the server rebuilds them from the run's config
VERA_PROJECTION_KEYS = (('seed',), ('model', 'type'), ('fsplug', 'model', 'builder'),
                        ('fsplug', 'model', 'vera'), ('fsplug', 'model', 'lora', 'target_modules'),
                        ('fsplug', 'model', 'vision', 'tower_lora_targets'))


@dataclass
class FedA2Config:
    ridge_mode: str = option(
        'when_singular', "when the Tikhonov λ applies: 'when_singular' = Eq. 13 / Algorithm 1 "
                         'lines 14-18, the exact least-squares B = U Aᵀ(A Aᵀ)⁻¹ unless A Aᵀ is '
                         'singular (cond ≥ singular_cond), then B = U Aᵀ(A Aᵀ + λI)⁻¹; '
                         "'always' = λ every round (Table 12's λ = 0.1 setting; ridge 0: its "
                         '"w/o Tik." row)', choices=RIDGE_MODES)
    ridge: float | None = option(
        1.0, 'Tikhonov λ of B = U Aᵀ(A Aᵀ + λI)⁻¹ where ridge_mode applies it (§3 after Eq. 13: '
             '"in practice λ = 1"; Table 12 uses 0.1 with ridge_mode always). null is refused: '
             'its old meaning (the case split) is ridge_mode when_singular', ge=0)
    singular_cond: float = option(
        FED_A2_SINGULAR_COND, 'A Aᵀ (and VeRA\'s diagonal Gram matrix) counts as singular, '
                              '"(A Aᵀ)⁻¹ does not exist" in Eq. 13, when its condition number '
                              'is at least this (1e6: a ~10x margin below 1/ε of float32, '
                              'where a float32 Gram matrix is singular to working precision)',
        gt=1)
    vera_ridge: float | None = option(
        None, "adapter vera: the λ of λ_b = argmin ‖diag(λ_b) M − U‖² + λ‖λ_b‖² "
              "(aggregation.lora.fed_a2_vera), applied as ridge_mode says with the same "
              "singular_cond on the diagonal Gram matrix diag(c_i G c_iᵀ); null: "
              "1e-6 × the mean of c_i G c_iᵀ. Not `ridge`: VeRA's c_i G c_iᵀ is ~0.02 at "
              "initialisation (λ_d = 0.1), so the LoRA λ = 1 would shrink λ_b ~50-fold "
              "whenever it applies", ge=0)
    fedavg_rounds: int = option(
        0, 'the first this many rounds aggregate by plain FedAvg of A and B (FedLoRA), FedA² '
           'afterwards: the two-stage GLUE protocol of Table 4 uses 200 of 1000 rounds; 0: '
           'FedA² from the first round', ge=0)


@dataclass
class VeraProjection:
    """One VeRA layer's frozen projections: slices of the model-wide shared A (r × max d_in)
    and B (max d_out × r), as peft's VeRA layer takes them in its forward pass."""
    shared_A: torch.Tensor
    shared_B: torch.Tensor
    d_in: int
    d_out: int

    @property
    def A(self) -> torch.Tensor:
        return self.shared_A[:, :self.d_in]

    @property
    def B(self) -> torch.Tensor:
        return self.shared_B[:self.d_out, :]


def vera_projections(model: torch.nn.Module) -> dict[str, VeraProjection]:
    """{λ_d parameter name: its layer's projections} for every VeRA layer of a peft model
    ({} without VeRA). The shared buffers are copied to the CPU once, not per layer."""
    cpu: dict[int, torch.Tensor] = {}

    def on_cpu(t):
        return cpu.setdefault(id(t), t.detach().to('cpu'))
    found = {}
    for name, module in model.named_modules():
        lambda_d = getattr(module, 'vera_lambda_d', None)
        if not isinstance(lambda_d, torch.nn.ParameterDict) or module.vera_A is None:
            continue
        for adapter in lambda_d:
            found[f'{name}.vera_lambda_d.{adapter}'] = VeraProjection(
                on_cpu(module.vera_A[adapter]), on_cpu(module.vera_B[adapter]),
                int(module.in_features), int(module.out_features))
    return found


@register_method
class FedA2LoRA(Method):
    name = 'fed_a2'
    robust_aggregation_refusal = "its B is solved analytically from every client's product B_k A_k"
    summary = ('FedA²-LoRA: A = Σp_kA_k, B = argmin‖BA − Σp_kB_kA_k‖² (+ λ‖B‖² when A Aᵀ is '
               'singular, Eq. 13; or every round: ridge_mode always), '
               'no d_out×d_in matrix formed; mixed ranks zero-padded to the largest, each client '
               'keeps its first r_k components; VeRA: λ_d averaged, λ_b fitted row by row; '
               'optional FedAvg first stage (fedavg_rounds)')
    sent = 'A, B / A, B (mixed ranks: own-rank / largest-rank); VeRA: λ_d, λ_b / λ_d, λ_b'
    config_class = FedA2Config

    def __init__(self, cfg):
        super().__init__(cfg)
        self.projections: dict[str, VeraProjection] | None = None
        self._conditions: list[float] = []

    @classmethod
    def config_problems(cls, hparams, cfg):
        problems = []
        adapter = cfg['fsplug']['model']['adapter']
        if adapter not in ('lora', 'vera'):
            problems.append(f"fsplug.model.adapter = {adapter!r}: fsplug.method = 'fed_a2' needs "
                            f"'lora' or 'vera' (FedA² solves for each layer's B from its A/B pair)")
        if hparams.ridge is None:
            problems.append(RIDGE_NULL_REFUSED)
        return problems

    @classmethod
    def client_problems(cls, run_cfg, client_cfg):
        """Every client uses the run's adapter; with VeRA also the run's projections (the
        server takes them from the run's config)."""
        paths = [('fsplug', 'model', 'adapter')]
        if run_cfg['fsplug']['model']['adapter'] == 'vera':
            paths += VERA_PROJECTION_KEYS
        return differing_client_keys(run_cfg, client_cfg, paths,
                                     "fsplug.method = 'fed_a2' aggregates one adapter type, and "
                                     "VeRA's frozen projections must be the server's")

    # ------------------------------------------------------------------ model
    def adapt_model(self, model, cfg):
        """Keeps the VeRA projections of the model built here: the server's global model."""
        self.projections = vera_projections(model)
        return model

    def init_client_state(self, model, cfg):
        self.projections = None   # only the server aggregates; the client's model holds them
        return {}

    # ----------------------------------------------------------------- server
    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'rounds': 0}

    def aggregate(self, server_state, updates):
        """FedAvg for the first `fedavg_rounds` aggregations, FedA² afterwards."""
        rounds = server_state.get('rounds', 0)
        if rounds < self.hparams.fedavg_rounds:
            state = self.aggregate_fedavg(server_state, updates)
        else:
            state = self.aggregate_fed_a2(server_state, updates)
        return {**state, 'rounds': rounds + 1}

    def aggregate_fedavg(self, server_state, updates):
        """FedLoRA: the weighted average of everything shared; mixed LoRA ranks by zero
        padding (hetlora_pad), as FedA²'s own A is."""
        shapes = {name: {tuple(u.shared[name].shape) for u in updates if name in u.shared}
                  for name in updates[0].shared}
        if all(len(s) == 1 for s in shapes.values()):
            return super().aggregate(server_state, updates)
        return {**server_state, 'global': aggregate_by_layer(
            server_state['global'], updates, lambda As, Bs, w: hetlora_pad(As, Bs, w))}

    def aggregate_fed_a2(self, server_state, updates):
        self._conditions = []   # each layer's Gram condition number this round (logged)
        keys = set.intersection(*(set(u.shared) for u in updates))
        if lora_pairs(keys):
            merged = aggregate_by_layer(server_state['global'], updates, self._combine_lora)
        elif vera_pairs(keys):
            merged = self._aggregate_vera(server_state['global'], updates, vera_pairs(keys))
        else:
            raise ValueError(f"fsplug.method = 'fed_a2': the clients share no LoRA A/B pair "
                             f"and no VeRA λ_d/λ_b pair (sent: {sorted(updates[0].shared)[:4]} "
                             f"...); FedA² needs fsplug.model.adapter: lora or vera")
        if self._conditions:
            logger.debug(f'fed_a2: Gram condition numbers over {len(self._conditions)} layers: '
                         f'max {max(self._conditions):.3g}, min {min(self._conditions):.3g}')
        return {**server_state, 'global': merged}

    def _ridge_options(self, lam) -> dict:
        return {'lam': lam, 'ridge_mode': self.hparams.ridge_mode,
                'singular_cond': self.hparams.singular_cond}

    def _combine_lora(self, As, Bs, weights):
        lam = self.hparams.ridge
        if lam is None:
            raise ValueError(RIDGE_NULL_REFUSED)
        info = {}
        try:
            merged = fed_a2(As, Bs, weights, pad=True, info=info, **self._ridge_options(lam))
        except ValueError as err:
            raise ValueError(f'{err} (fsplug.fed_a2.ridge_mode = {self.hparams.ridge_mode!r}, '
                             f'ridge = {lam})') from None
        self._note_singular(info, 'A Aᵀ')
        return merged

    def _note_singular(self, info: dict, what: str) -> None:
        self._conditions.append(info['cond'])
        if self.hparams.ridge_mode == 'when_singular' and info['lam'] > 0:
            logger.info(f"fed_a2: {what} is singular (condition number {info['cond']:.3g} >= "
                        f"singular_cond {self.hparams.singular_cond:.3g}): Tikhonov λ = "
                        f"{info['lam']:.3g} applied")

    def _aggregate_vera(self, global_state, updates, pairs):
        """λ_d and any other shared tensor averaged, λ_b by fed_a2_vera per layer."""
        weights = weights_of(updates)
        paired = {key for pair in pairs.values() for key in pair}
        out = {**global_state, **weighted_average(
            [{k: v for k, v in u.shared.items() if k not in paired} for u in updates], weights)}
        projections = self.vera_projections()
        for d_key, b_key in pairs.values():
            if d_key not in projections:
                raise ValueError(f"fsplug.method = 'fed_a2': no VeRA projections for '{d_key}' "
                                 f"in the server's model (built from the run's config)")
            layer = projections[d_key]
            info = {}
            out[d_key], out[b_key] = fed_a2_vera(
                layer.A, layer.B, [u.shared[d_key] for u in updates],
                [u.shared[b_key] for u in updates], weights, info=info,
                **self._ridge_options(self.hparams.vera_ridge))
            self._note_singular(info, f"VeRA's diag(c_i G c_iᵀ) of {d_key}")
        return out

    def vera_projections(self) -> dict[str, VeraProjection]:
        """The projections kept by `adapt_model`; built from the run's config when this
        instance has not built a model (e.g. aggregating outside a runner)."""
        if self.projections is None:
            build_model(self.cfg, self)   # calls adapt_model
        return self.projections

    def receive(self, model, content, state):
        receive_at_own_rank(model, content)
