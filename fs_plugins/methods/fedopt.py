"""FedAdagrad / FedAdam / FedYogi (Reddi et al., 2021): clients train as in FedAvg; the server
treats (sample-weighted average − global) as a pseudo-gradient and applies an adaptive
optimiser step to the global LoRA parameters (maths: aggregation/server_opt.py).

FederatedScope's FedOpt (`fedopt.use`) wraps a torch optimiser around the server model; the
plugin's server holds no model and the embedded runner no FS, so the step is written here."""
from dataclasses import dataclass

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.server_opt import adaptive_server_step
from fs_plugins.methods.base import Method, weights_of
from fs_plugins.methods.registry import register_method
from fs_plugins.schema import option


@dataclass
class ServerOptConfig:
    """Server optimiser of Reddi et al. (2021), Algorithm 2."""
    server_lr: float = option(0.01, 'server learning rate η', gt=0)
    beta1: float = option(0.9, 'first-moment decay β1', ge=0, lt=1)
    beta2: float = option(0.99, 'second-moment decay β2 (FedAdam, FedYogi)', ge=0, lt=1)
    tau: float = option(0.001, 'adaptivity τ added to √v', gt=0)


class _FedOpt(Method):
    variant = ''
    config_class = ServerOptConfig

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'moments': {}}

    def aggregate(self, server_state, updates):
        average = weighted_average([u.shared for u in updates], weights_of(updates))
        hp = self.hparams
        new_global, moments = adaptive_server_step(
            server_state['global'], average, server_state['moments'], self.variant,
            hp.server_lr, hp.beta1, hp.beta2, hp.tau)
        return {'global': new_global, 'moments': moments}


@register_method
class FedAdagrad(_FedOpt):
    name, variant = 'fedadagrad', 'adagrad'
    summary = ('server applies an adaptive step (Adagrad) to Δ = average − global (Reddi et al. '
               '2021)')
    sent = 'A, B / A, B'


@register_method
class FedAdam(_FedOpt):
    name, variant = 'fedadam', 'adam'
    summary = 'server applies an adaptive step (Adam) to Δ = average − global (Reddi et al. 2021)'
    sent = 'A, B / A, B'


@register_method
class FedYogi(_FedOpt):
    name, variant = 'fedyogi', 'yogi'
    summary = 'server applies an adaptive step (Yogi) to Δ = average − global (Reddi et al. 2021)'
    sent = 'A, B / A, B'
