"""Nash bargaining weights of Nash-MTL (Navon et al., "Multi-task learning as a bargaining
game", ICML 2022, §3, Eq. 2 / Theorem 3.2), as a pure function over task vectors.

Given K task vectors g_i (rows of G), the Nash bargaining solution is Σ α_i g_i with α > 0
solving (G Gᵀ α)_i = 1 / α_i. That α is the unique minimiser of the strictly convex
f(α) = ½ αᵀ M α − Σ log α_i, M = G Gᵀ (its gradient is M α − 1/α), found here by damped Newton
in K dimensions (Navon et al. solve a sequence of convex approximations with cvxpy instead;
both reach the same fixed point).

Our choices where the paper is silent or its setting differs: M is divided by its Frobenius
norm first, as the authors' code does, so α does not depend on the vectors' scale (for c·G the
solution is α/c); a zero task vector has no bargaining solution ((Mα)_i = 0) and gets α_i = 0;
when the other vectors are linearly dependent (M singular, e.g. g_2 = −g_1, where f is
unbounded below) a ridge of `ridge`·I is added to the normalised M.
"""
from __future__ import annotations

import torch

__all__ = ['nash_bargaining_alpha', 'nash_weights']


def nash_bargaining_alpha(task_vectors: torch.Tensor, ridge: float = 1e-8, tol: float = 1e-10,
                          max_iter: int = 200) -> torch.Tensor:
    """α (float64, shape (K,)) with (M α)_i · α_i = 1 for every nonzero task vector, where
    M = G Gᵀ / ‖G Gᵀ‖_F (+ ridge·I) over the nonzero rows of `task_vectors` (K, d); zero rows get
    α_i = 0. Raises ValueError on bad input or when Newton does not converge."""
    if not isinstance(task_vectors, torch.Tensor) or task_vectors.dim() != 2 \
            or task_vectors.shape[0] < 1:
        shape = tuple(task_vectors.shape) if isinstance(task_vectors, torch.Tensor) else None
        raise ValueError(f'task_vectors must be a (K >= 1, d) tensor, got {shape}')
    if not torch.isfinite(task_vectors).all():
        raise ValueError('task_vectors has non-finite entries')
    g = task_vectors.detach().to(torch.float64)
    alpha = torch.zeros(g.shape[0], dtype=torch.float64)
    active = g.norm(dim=1) > 0
    if not active.any():
        return alpha
    gram = g[active] @ g[active].T
    gram = gram / gram.norm()
    gram = gram + ridge * torch.eye(gram.shape[0], dtype=torch.float64)
    alpha[active] = _newton(gram, tol, max_iter)
    return alpha


def _objective(gram: torch.Tensor, alpha: torch.Tensor) -> float:
    return float(0.5 * alpha @ gram @ alpha - torch.log(alpha).sum())


def _newton(gram: torch.Tensor, tol: float, max_iter: int) -> torch.Tensor:
    """Minimises ½ αᵀ M α − Σ log α over α > 0 (damped Newton, backtracking line search)."""
    alpha = gram.diagonal().rsqrt()          # exact when the vectors are orthogonal
    for _ in range(max_iter):
        residual = gram @ alpha - 1.0 / alpha
        if float((residual * alpha).abs().max()) < tol:   # (Mα)_i α_i − 1, scale-free
            return alpha
        hessian = gram + torch.diag(alpha.pow(-2))
        step = torch.linalg.solve(hessian, residual)
        t, value = 1.0, _objective(gram, alpha)
        while True:
            candidate = alpha - t * step
            decrease = 0.25 * t * float(residual @ step)       # Armijo condition
            if bool((candidate > 0).all()) and _objective(gram, candidate) <= value - decrease:
                break
            t *= 0.5
            if t < 1e-12:
                raise ValueError('Nash bargaining: the line search stalled')
        alpha = candidate
    raise ValueError(f'Nash bargaining: Newton did not converge in {max_iter} iterations')


def nash_weights(task_vectors: torch.Tensor, ridge: float = 1e-8) -> torch.Tensor:
    """Aggregation weights w = α / Σ α (float32, shape (K,), summing to 1) from
    :func:`nash_bargaining_alpha`; uniform when every task vector is zero."""
    alpha = nash_bargaining_alpha(task_vectors, ridge)
    if not float(alpha.sum()) > 0:
        return torch.full((task_vectors.shape[0],), 1.0 / task_vectors.shape[0])
    return (alpha / alpha.sum()).to(torch.float32)
