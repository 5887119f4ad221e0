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
