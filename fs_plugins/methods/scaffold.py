"""SCAFFOLD (Karimireddy et al., 2020) on the shared LoRA parameters, option II.

Client i keeps a control variate c_i (client-local state); the server keeps c and sends it
with the global parameters. Every local step the gradient is corrected g ← g + c − c_i.
After K local steps with learning rate η, starting from x and ending at y:
    c_i⁺ = c_i − c + (x − y) / (K η),   the client sends y and Δc_i = c_i⁺ − c_i.
Server: x ← sample-weighted average of y (global step size 1),
        c ← c + (|S| / N) · mean_i Δc_i   (N = federate.client_num).
SCAFFOLD is derived for SGD; with an adaptive local optimiser the correction is applied to
the raw gradient all the same (a heuristic, as in most LLM ports)."""
import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.scaffold import scaffold_client_control, scaffold_server_control
from fs_plugins.methods.base import Contract, Method, load_tensors, weights_of
from fs_plugins.methods.registry import register_method

CONTROL = 'control/'


@register_method
class Scaffold(Method):
    name = 'scaffold'
    summary = ('control variates c, c_i; each local gradient corrected by c − c_i (option II; use'
               ' SGD locally)')
    sent = 'A, B, Δc_i / A, B, c'
    contract = Contract(extra=(CONTROL + '*',))

    def init_client_state(self, model, cfg):
        return {'c_i': {}, 'c': {}, 'start': {}, 'steps': 0}

    def receive(self, model, content, state):
        params = {k: v for k, v in content.items() if not k.startswith(CONTROL)}
        load_tensors(model, params)
        state['c'] = {k[len(CONTROL):]: v.detach().clone() for k, v in content.items()
                      if k.startswith(CONTROL)}
        state['start'] = {k: v.detach().clone() for k, v in params.items()}
        state['steps'] = 0

    def before_optimizer_step(self, model, state):
        for name, param in model.named_parameters():
            if param.grad is None or name not in state['c']:
                continue
            c_i = state['c_i'].get(name)
            correction = state['c'][name].to(param.device)
            if c_i is not None:
                correction = correction - c_i.to(param.device)
            param.grad.add_(correction.to(param.grad.dtype))

    def after_step(self, model, state):
        state['steps'] += 1

    def client_extra(self, model, state):
        if not state['start'] or not state['steps']:
            return {}
        lr = self.cfg.train.optimizer.lr
        params = dict(model.named_parameters())
        deltas = {}
        for name, start in state['start'].items():
            c = state['c'].get(name, torch.zeros_like(start))
            c_i = state['c_i'].get(name, torch.zeros_like(start))
            y = params[name].detach().to('cpu', start.dtype)
            new_c_i = scaffold_client_control(c_i, c, start, y, state['steps'], lr)
            deltas[CONTROL + name] = new_c_i - c_i
            state['c_i'][name] = new_c_i
        return deltas

    def extra_payload_shapes(self, model, cfg):
        """Δc_i: one control-variate change per shared tensor, of its shape."""
        return {CONTROL + n: tuple(p.shape) for n, p in model.named_parameters()
                if p.requires_grad and self.is_shared(n)}

    def init_server_state(self, initial_shared):
        return {'global': dict(initial_shared),
                'c': {k: torch.zeros_like(v, dtype=torch.float32) for k, v in initial_shared.items()}}

    def aggregate(self, server_state, updates):
        merged = weighted_average([u.shared for u in updates], weights_of(updates))
        c = dict(server_state['c'])
        for name in c:
            deltas = [u.extra[CONTROL + name] for u in updates if CONTROL + name in u.extra]
            c[name] = scaffold_server_control(c[name], deltas, len(updates),
                                              self.cfg.federate.client_num)
        return {'global': {**server_state['global'], **merged}, 'c': c}

    def content_for(self, server_state, client_id):
        return {**server_state['global'],
                **{CONTROL + k: v for k, v in server_state['c'].items()}}
