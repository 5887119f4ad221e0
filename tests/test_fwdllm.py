"""FwdLLM: the forward-gradient estimate against the true gradient in expectation, the
directional derivatives (jvp, finite differences) against autograd, the discriminative sampling
and the variance pacing against naive loops, the server step, and a tiny run with no backward."""
from types import SimpleNamespace

import pytest
import torch
from helpers import run_embedded_keeping_clients, tiny_config, write_yaml
from test_methods import direct_method, naive_weighted_mean, train_rows

from fs_plugins.aggregation.forward_gradient import next_perturbation_count, relative_update_variance
from fs_plugins.methods.base import ClientUpdate
from fs_plugins.methods.fwdllm import (
    DIRECTION_KEY,
    PERTURBATIONS_KEY,
    forward_gradient,
    most_aligned,
)
from fs_plugins.run.config import load_config


class LinearRegression(torch.nn.Module):
    """loss = mean (x·w + b − y)², returned as `.loss` like a Hugging Face model."""

    def __init__(self, gen, features=5):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(features, generator=gen, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn((), generator=gen, dtype=torch.float64))

    def forward(self, x, y):
        return SimpleNamespace(loss=((x @ self.w + self.b - y) ** 2).mean())


def linear_case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = LinearRegression(gen)
    batch = {'x': torch.randn(16, 5, generator=gen, dtype=torch.float64),
             'y': torch.randn(16, generator=gen, dtype=torch.float64)}
    model(**batch).loss.backward()
    true = torch.cat([model.w.grad, model.b.grad.reshape(1)])
    return model, batch, true


def test_forward_gradient_is_the_true_gradient_in_expectation():
    model, batch, true = linear_case()
    gen = torch.Generator().manual_seed(1)
    vectors = torch.randn(40000, 6, generator=gen, dtype=torch.float64)
    estimate = forward_gradient(vectors @ true, vectors)     # d_k = ∇L·v_k exactly
    assert float((estimate - true).norm() / true.norm()) < 0.03
    few = forward_gradient(vectors[:3] @ true, vectors[:3])
    assert float((few - true).norm() / true.norm()) > 0.03   # one draw of few is noisy


@pytest.mark.parametrize('derivative', ['jvp', 'finite_difference'])
def test_directional_derivative_is_autograds(tmp_path, derivative):
    method = direct_method(tmp_path, 'fwdllm', fsplug={'fwdllm': {'derivative': derivative,
                                                                 'epsilon': 1e-4}})
    model, batch, true = linear_case(3)
    params = dict(sorted(model.named_parameters()))
    gen = torch.Generator().manual_seed(4)
    tangent = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in params.items()}
    derivative_value, loss = method._directional(model, params, tangent, batch,
                                                 {'jvp_failed': False})
    flat_tangent = torch.cat([tangent['w'], tangent['b'].reshape(1)])
    assert float(derivative_value) == pytest.approx(float(true @ flat_tangent), rel=1e-6)
    assert float(loss) == pytest.approx(float(model(**batch).loss), rel=1e-6)


def test_discriminative_sampling_keeps_the_most_aligned_candidates():
    gen = torch.Generator().manual_seed(5)
    candidates, direction = torch.randn(12, 7, generator=gen), torch.randn(7, generator=gen)
    cos = [abs(float(c @ direction)) / float(c.norm() * direction.norm()) for c in candidates]
    naive = sorted(sorted(range(12), key=lambda i: -cos[i])[:4])
    assert most_aligned(candidates, direction, 4).tolist() == naive
    assert most_aligned(candidates, torch.zeros(7), 4).tolist() == [0, 1, 2, 3]


def test_variance_pacing_doubles_perturbations_while_clients_disagree():
    gen = torch.Generator().manual_seed(6)
    updates, weights = [torch.randn(9, generator=gen) for _ in range(3)], [1, 2, 5]
    mean = naive_weighted_mean(updates, weights)
    naive = sum(w * float((u.double() - mean).pow(2).sum()) for u, w in zip(updates, weights))
    naive /= sum(weights) * float(mean.pow(2).sum())
    assert relative_update_variance(updates, weights) == pytest.approx(naive, rel=1e-9)
    assert relative_update_variance([torch.ones(3)] * 2, [1, 1]) == 0
    assert next_perturbation_count(10, 2.0, 1.0, 80) == 20
    assert next_perturbation_count(50, 2.0, 1.0, 80) == 80
    assert next_perturbation_count(10, 0.5, 1.0, 80) == 10


def test_server_averages_and_sends_the_global_update_direction(tmp_path):
    method = direct_method(tmp_path, 'fwdllm', fsplug={'fwdllm': {'perturbations': 3,
                                                                 'max_perturbations': 5}})
    gen = torch.Generator().manual_seed(7)
    start = {'m.lora_A': torch.randn(2, 3, generator=gen), 'm.lora_B': torch.randn(3, 2, generator=gen)}
    common = {n: 0.1 * torch.randn(v.shape, generator=gen) for n, v in start.items()}
    noise = {n: torch.randn(v.shape, generator=gen) for n, v in start.items()}
    disagreeing = [{n: start[n] + common[n] + sign * noise[n] for n in start} for sign in (1, -1)]
    agreeing = [{n: start[n] + common[n] for n in start}] * 2
    for shared, count in [(disagreeing, 5), (agreeing, 3)]:   # 3 → min(6, 5) / kept
        server = method.aggregate(method.init_server_state(start),
                                  [ClientUpdate(k, n, s) for k, (n, s) in enumerate(zip([1, 3], shared))])
        expected = {n: naive_weighted_mean([s[n] for s in shared], [1, 3]) for n in start}
        for name in start:
            torch.testing.assert_close(server['global'][name].double(), expected[name])
        direction = torch.cat([(expected[n] - start[n].double()).reshape(-1) for n in sorted(start)])
        content = method.content_for(server, 0)
        torch.testing.assert_close(content[DIRECTION_KEY].double(), direction)
        assert int(content[PERTURBATIONS_KEY]) == count


@pytest.mark.slow
def test_fwdllm_end_to_end_trains_without_backward(tmp_path):
    cfg = tiny_config(tmp_path, 'fwdllm', rounds=2, steps=2,
                      fsplug={'fwdllm': {'perturbations': 2, 'max_perturbations': 4}})
    loaded = load_config(write_yaml(tmp_path / 'c.yaml', cfg))
    results, clients = run_embedded_keeping_clients(loaded)
    assert {r['round'] for r in train_rows(results)} == {0, 1}
    for client in clients.values():
        params = [p for n, p in client.params.items() if n in client.trainable_names]
        assert params and all(p.grad is None for p in params)   # no backward ever ran
        assert client.state['perturbations'] in (2, 4)
        assert float(client.state['direction'].norm()) > 0    # round 1 got round 0's update
