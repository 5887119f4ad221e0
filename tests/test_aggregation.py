import pytest
import torch

from fs_plugins.aggregation import weighted_average
from fs_plugins.aggregation.average import normalise_weights


def _naive(states, weights, key):
    total = sum(w for s, w in zip(states, weights) if key in s)
    return sum(s[key].double() * (w / total) for s, w in zip(states, weights) if key in s)


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_weighted_average_matches_naive(dtype):
    gen = torch.Generator().manual_seed(0)
    states = [{'a': torch.randn(4, 3, generator=gen).to(dtype),
               'b': torch.randn(5, generator=gen).to(dtype)} for _ in range(3)]
    weights = [10, 30, 60]
    out = weighted_average(states, weights)
    for key in ('a', 'b'):
        assert out[key].dtype == dtype
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(out[key].double(), _naive(states, weights, key), atol=tol, rtol=tol)


def test_keys_held_by_some_clients_average_over_holders():
    states = [{'a': torch.ones(2), 'local': torch.zeros(1)}, {'a': 3 * torch.ones(2)}]
    out = weighted_average(states, [1, 1])
    torch.testing.assert_close(out['a'], 2 * torch.ones(2))
    torch.testing.assert_close(out['local'], torch.zeros(1))


def test_shape_mismatch_names_key():
    with pytest.raises(ValueError, match="'w'"):
        weighted_average([{'w': torch.ones(2, 4)}, {'w': torch.ones(2, 8)}], [1, 1])


def test_weights_validation():
    torch.testing.assert_close(normalise_weights([1, 3]), torch.tensor([0.25, 0.75], dtype=torch.float64))
    with pytest.raises(ValueError):
        normalise_weights([0, 0])
    with pytest.raises(ValueError):
        normalise_weights([1, -1])


# ------------------------------------------------------------------------------ SCAFFOLD

def _scaffold_client_naive(c_i, c, start, end, steps, lr):
    """c_i⁺ = c_i − c + (x − y) / (K η), element by element in Python floats."""
    return [ci - cc + (x - y) / (steps * lr) for ci, cc, x, y in zip(c_i, c, start, end)]


def _scaffold_server_naive(c, deltas, num_sampled, num_clients):
    """c ← c + (|S| / N) · mean_i Δc_i, element by element in Python floats."""
    if not deltas:
        return list(c)
    return [cc + (num_sampled / num_clients) * sum(d[j] for d in deltas) / len(deltas)
            for j, cc in enumerate(c)]


@pytest.mark.parametrize('steps, lr', [(1, 1.0), (3, 0.01), (7, 0.25)])
def test_scaffold_client_control_matches_naive(steps, lr):
    from fs_plugins.aggregation.scaffold import scaffold_client_control
    c_i = [0.5, -1.0, 0.0, 2.0]
    c = [0.25, 0.75, -0.5, 1.0]
    start = [1.0, 2.0, -3.0, 0.5]
    end = [0.9, 2.2, -3.0, 0.0]
    tensors = [torch.tensor(x, dtype=torch.float64) for x in (c_i, c, start, end)]
    originals = [t.clone() for t in tensors]
    out = scaffold_client_control(*tensors, steps=steps, lr=lr)
    expected = torch.tensor(_scaffold_client_naive(c_i, c, start, end, steps, lr), dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # x = y leaves only c_i − c (no drift term)
    same = scaffold_client_control(tensors[0], tensors[1], tensors[2], tensors[2], steps, lr)
    torch.testing.assert_close(same, torch.tensor([a - b for a, b in zip(c_i, c)], dtype=torch.float64))
    # inputs untouched
    assert all(torch.equal(t, o) for t, o in zip(tensors, originals))


@pytest.mark.parametrize('steps, lr', [(0, 0.1), (-1, 0.1), (3, 0.0), (3, -0.01)])
def test_scaffold_client_control_rejects_bad_steps_or_lr(steps, lr):
    from fs_plugins.aggregation.scaffold import scaffold_client_control
    z = torch.zeros(3)
    with pytest.raises(ValueError, match='steps'):
        scaffold_client_control(z, z, z, z + 1, steps, lr)


@pytest.mark.parametrize('num_sampled, num_clients', [(2, 2), (2, 5), (3, 10)])
def test_scaffold_server_control_matches_naive(num_sampled, num_clients):
    from fs_plugins.aggregation.scaffold import scaffold_server_control
    c = [0.1, -0.2, 0.3]
    deltas = [[1.0, 2.0, -1.0], [0.5, -4.0, 3.0], [-0.25, 0.0, 6.0]][:num_sampled]
    out = scaffold_server_control(torch.tensor(c), [torch.tensor(d) for d in deltas],
                                  num_sampled, num_clients)
    expected = torch.tensor(_scaffold_server_naive(c, deltas, num_sampled, num_clients))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    # partial participation scales the mean by |S| / N: more clients, smaller step
    if num_clients > num_sampled:
        full = scaffold_server_control(torch.tensor(c), [torch.tensor(d) for d in deltas],
                                       num_sampled, num_sampled)
        torch.testing.assert_close(out - torch.tensor(c),
                                   (full - torch.tensor(c)) * num_sampled / num_clients)


def test_scaffold_server_control_without_deltas_keeps_c():
    from fs_plugins.aggregation.scaffold import scaffold_server_control
    c = torch.tensor([0.1, -0.2, 0.3])
    for num_sampled, num_clients in ((0, 4), (0, 0)):
        out = scaffold_server_control(c, [], num_sampled, num_clients)
        torch.testing.assert_close(out, torch.tensor(_scaffold_server_naive([0.1, -0.2, 0.3], [], 0, 4)))
        assert torch.equal(out, c)
