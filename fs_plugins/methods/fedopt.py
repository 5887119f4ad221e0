"""FedAdagrad / FedAdam / FedYogi (Reddi et al., 2021): clients train as in FedAvg; the server
treats (sample-weighted average − global) as a pseudo-gradient and applies an adaptive
optimiser step to the global LoRA parameters (maths: aggregation/server_opt.py).

FederatedScope's FedOpt (`fedopt.use`) wraps a torch optimiser around the server model; the
plugin's server holds no model and the embedded runner no FS, so the step is written here."""
from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.server_opt import adaptive_server_step
from fs_plugins.methods.base import Method
from fs_plugins.methods.registry import register_method

SERVER_OPT_DEFAULTS = {'server_lr': 0.01, 'beta1': 0.9, 'beta2': 0.99, 'tau': 0.001}


class _FedOpt(Method):
    variant = ''
    defaults = SERVER_OPT_DEFAULTS

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared), 'moments': {}}

    def aggregate(self, server_state, updates):
        average = weighted_average([u.shared for u in updates], [u.num_samples for u in updates])
        hp = self.hparams
        new_global, moments = adaptive_server_step(
            server_state['global'], average, server_state['moments'], self.variant,
            float(hp['server_lr']), float(hp['beta1']), float(hp['beta2']), float(hp['tau']))
        return {'global': new_global, 'moments': moments}


@register_method
class FedAdagrad(_FedOpt):
    name, variant = 'fedadagrad', 'adagrad'


@register_method
class FedAdam(_FedOpt):
    name, variant = 'fedadam', 'adam'


@register_method
class FedYogi(_FedOpt):
    name, variant = 'fedyogi', 'yogi'
