"""FedA²-LoRA (UniFLoW): per LoRA layer, A = Σ p_k A_k and B solves
min ‖B A − Σ p_k B_k A_k‖²_F + λ‖B‖²_F, i.e. B = U Aᵀ (A Aᵀ + λI)⁻¹ with the Tikhonov term
applied every round (Algorithm 1 line 17; λ = 1 by default, §3 after Eq. 13), so the global
product B·A is the best ridge fit of the averaged updates in A's row space. Computed without
forming any d_out × d_in matrix (aggregation.lora.fed_a2). Clients of different LoRA ranks
(`--client_cfg` fsplug.model.lora.r) are zero-padded to the largest rank (appendix E.4,
Table 10) and each keeps the first r_k components of the global factors. Upload equals
FedAvg-LoRA's.

Two-stage schedule (§4, text around Table 4: "FedLoRA during the first 200 communication
rounds", then FedA²): `fedavg_rounds` N makes the first N aggregations plain FedAvg of A and
B (zero-padded averaging for mixed ranks, Table 10's "LoRA (zero-padding)"). The server
counts its aggregations in its state (`rounds`, as PerAda's kd_rounds does), so both runners
(embedded and FederatedScope) switch after the same round.

VeRA (`fsplug.model.adapter: vera`, Table 4's "FedA²-VeLoRA"): ΔW = diag(λ_b) B diag(λ_d) A
with A, B frozen and shared; λ_d (A's part) is averaged and λ_b (B's part) is the ridge fit
of Σ p_k ΔW_k, row by row (aggregation.lora.fed_a2_vera has the derivation), with its own λ
(`vera_ridge`, default Eq. 13's case split: the paper's λ = 1 is calibrated for LoRA's B;
against VeRA's c_i G c_iᵀ ≈ 0.02 at initialisation it would all but erase λ_b). The server needs
the frozen projections: it takes them from the global model it builds from the run's config
at start-up (`initial_global` calls `adapt_model`), since they are drawn from the run's seed
(peft's projection_prng_key) exactly as on every client; nothing extra is uploaded.
`client_problems` keeps every client on the run's adapter and on the keys that determine the
projections."""
from dataclasses import dataclass

import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.lora import fed_a2, fed_a2_vera, hetlora_pad
from fs_plugins.aggregation.pairs import lora_pairs, vera_pairs
from fs_plugins.methods.base import Method, differing_client_keys, weights_of
from fs_plugins.methods.building import build_model
from fs_plugins.methods.lora_family import aggregate_by_layer, receive_at_own_rank
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option

# what fixes VeRA's frozen projections (peft draws them from the seed, sized by the targeted
# layers): a client may not change these when the server rebuilds them from the run's config
VERA_PROJECTION_KEYS = (('seed',), ('model', 'type'), ('fsplug', 'model', 'builder'),
                        ('fsplug', 'model', 'vera'), ('fsplug', 'model', 'lora', 'target_modules'),
                        ('fsplug', 'model', 'vision', 'tower_lora_targets'))


@dataclass
class FedA2Config:
    ridge: float | None = option(
        1.0, 'Tikhonov λ of B = U Aᵀ(A Aᵀ + λI)⁻¹, applied every round (UniFLoW Alg. 1 line 17; '
             '§3 after Eq. 13: "in practice λ = 1"; Table 12 uses 0.1 on image/audio); '
             '0: the "w/o Tik." ablation of Table 12; null: Eq. 13\'s case split, λ only when '
             'A Aᵀ is ill conditioned (cond ≥ 1e6: the fallback ridge of aggregation.lora.fed_a2)',
        ge=0)
    vera_ridge: float | None = option(
        None, "adapter vera: the λ of λ_b = argmin ‖diag(λ_b) M − U‖² + λ‖λ_b‖² "
              "(aggregation.lora.fed_a2_vera); null: Eq. 13's case split, λ only when the "
              "diagonal Gram matrix diag(c_i G c_iᵀ) is ill conditioned (max/min ≥ 1e6). Not "
              "`ridge`: VeRA's c_i G c_iᵀ is ~0.02 at initialisation (λ_d = 0.1), so the LoRA "
              "default λ = 1 would shrink λ_b ~50-fold every round", ge=0)
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
    summary = ('FedA²-LoRA: A = Σp_kA_k, B = argmin‖BA − Σp_kB_kA_k‖² + λ‖B‖² (λ every round), '
               'no d_out×d_in matrix formed; mixed ranks zero-padded to the largest, each client '
               'keeps its first r_k components; VeRA: λ_d averaged, λ_b fitted row by row; '
               'optional FedAvg first stage (fedavg_rounds)')
    sent = 'A, B / A, B (mixed ranks: own-rank / largest-rank); VeRA: λ_d, λ_b / λ_d, λ_b'
    config_class = FedA2Config

    def __init__(self, cfg):
        super().__init__(cfg)
        self.projections: dict[str, VeraProjection] | None = None

    @classmethod
    def config_problems(cls, hparams, cfg):
        adapter = cfg['fsplug']['model']['adapter']
        if adapter not in ('lora', 'vera'):
            return [f"fsplug.model.adapter = {adapter!r}: fsplug.method = 'fed_a2' needs 'lora' "
                    f"or 'vera' (FedA² solves for each layer's B from its A/B pair)"]
        return []

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
        keys = set.intersection(*(set(u.shared) for u in updates))
        if lora_pairs(keys):
            merged = aggregate_by_layer(server_state['global'], updates, self._combine_lora)
        elif vera_pairs(keys):
            merged = self._aggregate_vera(server_state['global'], updates, vera_pairs(keys))
        else:
            raise ValueError(f"fsplug.method = 'fed_a2': the clients share no LoRA A/B pair "
                             f"and no VeRA λ_d/λ_b pair (sent: {sorted(updates[0].shared)[:4]} "
                             f"...); FedA² needs fsplug.model.adapter: lora or vera")
        return {**server_state, 'global': merged}

    def _combine_lora(self, As, Bs, weights):
        lam = self.hparams.ridge
        try:
            return fed_a2(As, Bs, weights, lam=lam, pad=True)
        except ValueError as err:
            raise ValueError(f'{err} (fsplug.fed_a2.ridge = {lam})') from None

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
            out[d_key], out[b_key] = fed_a2_vera(
                layer.A, layer.B, [u.shared[d_key] for u in updates],
                [u.shared[b_key] for u in updates], weights, lam=self.hparams.vera_ridge)
        return out

    def vera_projections(self) -> dict[str, VeraProjection]:
        """The projections kept by `adapt_model`; built from the run's config when this
        instance has not built a model (e.g. aggregating outside a runner)."""
        if self.projections is None:
            build_model(self.cfg, self)   # calls adapt_model
        return self.projections

    def receive(self, model, content, state):
        receive_at_own_rank(model, content)
