"""Ways to compose a library of frozen LoRA adapters on one linear layer. Each is a module
attached to the layer (child `library`) whose output a forward hook adds to the layer's.

An adapter n of rank r_n on the layer is r_n rank-1 experts b_i a_iᵀ (B's column, A's row):
    B_n A_n x = Σ_{i in n} b_i (a_iᵀ x).
All the layer's experts are stacked: A (E, d_in), B_t (E, d_out) = Bᵀ, E = Σ_n r_n.

- `RankWiseExperts` (SmartFed's MoRE): a router scores the E experts per token; the top-q run.
  `rank_one_mixture` computes only the selected experts — sparse CSR kernels (SDDMM and
  sparse @ dense, with their own backward: `selected_inputs`, `selected_outputs`) — so compute
  grows with q, not with E.
- `MergedLora` (linear arithmetic, LoRAHub): (Σ λ_n B_n)(Σ λ_n A_n) x, weights λ over whole
  adapters (the paper's Eq. 3, cross terms included).
- `LoraGate` (MoLE): every adapter runs; a gate over whole adapters per token from their
  normalised, concatenated outputs.
- `FlowMixture` (LoRA-Flow): every adapter runs; per-token weights from a gate of the decoder
  layer the module belongs to (`FlowGate`, fed the layer's input hidden state).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fs_plugins.models.checkpointing import recomputing

LIBRARY_ATTR = 'library'


def _selection(idx: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The (T, E) sparse CSR matrix with `values` (T, q) at row t, columns idx[t] (sorted)."""
    tokens, q = idx.shape
    crow = torch.arange(0, tokens * q + 1, q, device=idx.device, dtype=torch.int64)
    return torch.sparse_csr_tensor(crow, idx.reshape(-1), values.reshape(-1),
                                   size=(tokens, num_experts), check_invariants=False)


def _sampled(idx: torch.Tensor, left: torch.Tensor, right_t: torch.Tensor) -> torch.Tensor:
    """(left @ right_tᵀ)[t, idx[t]] only (a sampled dense-dense product, SDDMM): (T, q)."""
    pattern = _selection(idx, left.new_ones(idx.shape), right_t.shape[0])
    return torch.sparse.sampled_addmm(pattern, left, right_t.t(), beta=0.0).values().view(idx.shape)


def _in_dtype_of(factor: torch.Tensor):
    """No autocast around the sparse kernels: they run in the trainable factor's dtype (float32
    over a bfloat16 base), as autocast has no rule for them and would mix dtypes; autograd
    casts the gradients back to the inputs' dtypes."""
    return torch.autocast(factor.device.type, enabled=False)


class _SelectedInputs(torch.autograd.Function):
    """low_tk = a_{e_tk}ᵀ x_t for the q selected experts e_t of token t (idx sorted per row):
    T·q·d_in multiply-adds forward (SDDMM) and backward (sparse @ dense)."""

    @staticmethod
    def forward(ctx, x, idx, A):
        ctx.save_for_backward(idx, A)
        with _in_dtype_of(A):
            return _sampled(idx, x.to(A.dtype), A)

    @staticmethod
    def backward(ctx, grad_low):
        idx, A = ctx.saved_tensors
        with _in_dtype_of(A):
            return _selection(idx, grad_low.to(A.dtype).contiguous(), A.shape[0]) @ A, None, None


class _SelectedOutputs(torch.autograd.Function):
    """out_t = Σ_k c_tk b_{e_tk} over the q selected experts: T·q·d_out multiply-adds forward
    (sparse @ dense) and backward (SDDMM)."""

    @staticmethod
    def forward(ctx, coef, idx, B_t):
        ctx.save_for_backward(idx, B_t)
        with _in_dtype_of(B_t):
            return _selection(idx, coef.to(B_t.dtype).contiguous(), B_t.shape[0]) @ B_t

    @staticmethod
    def backward(ctx, grad_out):
        idx, B_t = ctx.saved_tensors
        with _in_dtype_of(B_t):
            return _sampled(idx, grad_out.to(B_t.dtype).contiguous(), B_t), None, None


def selected_inputs(x, idx, A):
    return _SelectedInputs.apply(x, idx, A)


def selected_outputs(coef, idx, B_t):
    return _SelectedOutputs.apply(coef, idx, B_t)


def rank_one_mixture(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                     A: torch.Tensor, B_t: torch.Tensor) -> torch.Tensor:
    """Σ over the selected rank-1 experts (idx (T, q); weights (T, q)) of x
    (T, d_in); only those experts are computed: T·q·(d_in + d_out) multiply-adds, whatever E is."""
    idx, order = idx.sort(dim=-1)
    weights = weights.gather(-1, order)
    return selected_outputs(weights * selected_inputs(x, idx, A), idx, B_t)


def dense_rank_mixture(x: torch.Tensor, rank_weights: torch.Tensor, A: torch.Tensor,
                       B_t: torch.Tensor) -> torch.Tensor:
    """Every expert on every token: ((x Aᵀ) ⊙ rank_weights) B_t; rank_weights (T, E) or (E,)."""
    return (F.linear(x, A) * rank_weights) @ B_t


def _top(logits: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-q logits per row and their expert indices, in expert order (CSR rows)."""
    top, idx = logits.topk(q, dim=-1)
    idx, order = idx.sort(dim=-1)
    return top.gather(-1, order), idx


def _tokens(x: torch.Tensor, width: int) -> torch.Tensor:
    return x.reshape(-1, width).float()


class _LibraryFactors(nn.Module):
    """The layer's frozen experts as non-persistent buffers (rebuilt from the library folders,
    never saved with the trained state)."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor, owner: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = A.shape[1], B.shape[0]
        self.register_buffer('A', A.float().contiguous(), persistent=False)
        self.register_buffer('B_t', B.t().float().contiguous(), persistent=False)
        self.register_buffer('owner', owner, persistent=False)
        # the library adapters on this layer (owner is grouped by adapter) and their ranks
        adapters, ranks = owner.unique_consecutive(return_counts=True)
        self.adapters, self.adapter_ranks = adapters, ranks.tolist()

    @property
    def num_experts(self) -> int:
        return self.A.shape[0]

    def _out(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return flat.reshape(*x.shape[:-1], self.out_features)


class RankWiseExperts(_LibraryFactors):
    """MoRE on one matrix: a router scores the layer's routed units, the top-q (q = the quota)
    get g = gate_scale · softmax(z over the q selected), Δh = Σ g_u (the unit's B A x).

    Units (`granularity`): 'rank' (MoRE) — the E rank-1 experts b_i a_iᵀ; 'module' (the
    ablation "w/o MoRE") — the N whole library adapters on the layer (all of an adapter's
    rank-1 experts run with its one gate, the softmax over all N adapters' logits kept for the
    top-q, times N with gate_scale 'quota': at top-1 a softmax over the selected alone is a
    constant 1 and the router would not learn; a layer only one adapter targets has no router:
    that adapter always runs, as MoLE's gate-less layers). The quota counts units.

    Router (`router_input`): 'experts' — z = W_r (A x), W_r (units × E) over the experts' own
    activations a_iᵀx (A x is computed for every expert anyway: the top-q need it); 'hidden' —
    z = W_r x, W_r (units × d_in). gate_scale 'quota' multiplies by q, so uniform gates give
    each selected unit weight 1 (all selected, uniform: the sum of the library's LoRAs); 'one'
    keeps Σ g = 1. Rank granularity computes only the selected experts (`rank_one_mixture`);
    module granularity does so when the layer's adapters have one rank, else the dense masked
    formula."""

    def __init__(self, A, B, owner, quota: int, gate_scale: str = 'quota',
                 router_init_std: float = 0.0, router_input: str = 'experts',
                 granularity: str = 'rank'):
        super().__init__(A, B, owner)
        if granularity not in ('rank', 'module'):
            raise ValueError(f"granularity '{granularity}': 'rank' or 'module'")
        self.granularity = granularity
        units = self.num_experts if granularity == 'rank' else len(self.adapter_ranks)
        self.num_units = units
        width = self.in_features if router_input == 'hidden' else self.num_experts
        self.router_input = router_input
        if units > 1 or granularity == 'rank':
            self.router = nn.Parameter(torch.zeros(units, width))
            if router_init_std > 0:
                nn.init.normal_(self.router, std=router_init_std)
        else:
            self.router = None
        # module granularity: each rank-1 expert's adapter position on this layer (0 .. N-1)
        self.register_buffer('unit_of', torch.repeat_interleave(
            torch.arange(len(self.adapter_ranks)), torch.tensor(self.adapter_ranks)), persistent=False)
        self.gate_scale = gate_scale
        self.quota = min(int(quota), units)
        self.importance_hook = None   # set while EEQA measures importance: fn(delta)

    @property
    def activated_rank(self) -> float:
        """Rank-1 experts a token runs here: the quota (rank), or the selected adapters' ranks
        (module; their mean rank times the quota when the layer's adapters differ in rank)."""
        q = max(0, min(self.quota, self.num_units))
        if self.granularity == 'rank':
            return float(q)
        return float(q * sum(self.adapter_ranks) / len(self.adapter_ranks))

    def _logits(self, tokens: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
        if self.router_input == 'experts':
            return F.linear(low, self.router)
        return F.linear(tokens, self.router)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = _tokens(x, self.in_features)
        q = self.quota
        if q <= 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        forward = self._modules_forward if self.granularity == 'module' else self._ranks_forward
        delta = forward(tokens, q)
        if self.importance_hook is not None and not recomputing():
            self.importance_hook(delta)
        return self._out(delta, x)

    def _scale(self, q: int) -> float:
        return float(q) if self.gate_scale == 'quota' else 1.0

    def _ranks_forward(self, tokens: torch.Tensor, q: int) -> torch.Tensor:
        scale = self._scale(q)
        if self.router_input == 'experts':
            # the experts' own activations a_iᵀx feed an E × E router; only the selected
            # experts' outputs are computed
            low = F.linear(tokens, self.A)
            logits = self._logits(tokens, low)
            if q >= self.num_experts:
                return (low * logits.softmax(-1) * scale) @ self.B_t
            top, idx = _top(logits, q)
            coef = low.gather(1, idx) * top.softmax(-1) * scale
            return selected_outputs(coef, idx, self.B_t)
        logits = self._logits(tokens, None)
        if q >= self.num_experts:
            return dense_rank_mixture(tokens, logits.softmax(-1) * scale, self.A, self.B_t)
        top, idx = _top(logits, q)
        return rank_one_mixture(tokens, top.softmax(-1) * scale, idx, self.A, self.B_t)

    def _modules_forward(self, tokens: torch.Tensor, q: int) -> torch.Tensor:
        """Whole adapters as the units: the top-q adapters per token, each adapter's rank-1
        experts at its gate."""
        n = self.num_units
        q = min(q, n)
        if self.router is None:   # one adapter: it runs whole, at weight 1 (no routing)
            return dense_rank_mixture(tokens, tokens.new_ones(self.num_experts), self.A, self.B_t)
        low = F.linear(tokens, self.A) if self.router_input == 'experts' else None
        logits = self._logits(tokens, low)
        # the softmax over all N adapters, kept for the top-q (a softmax over the selected alone
        # is 1 at top-1, and the router would never learn); 'quota' scales by N: uniform gates
        # give each selected adapter weight 1
        probs = logits.softmax(-1) * (float(n) if self.gate_scale == 'quota' else 1.0)
        if q >= n:
            return self._adapter_mixture(tokens, low, probs[:, self.unit_of])
        _, chosen = _top(logits, q)
        gates = probs.gather(1, chosen)                     # (T, q) over the chosen adapters
        if len(set(self.adapter_ranks)) == 1:   # one rank r: the chosen adapters' q·r experts only
            rank = self.adapter_ranks[0]
            offsets = torch.arange(rank, device=chosen.device)
            idx = (chosen * rank).unsqueeze(-1).add(offsets).reshape(chosen.shape[0], -1)  # sorted
            weights = gates.repeat_interleave(rank, dim=1)
            if low is None:
                return rank_one_mixture(tokens, weights, idx, self.A, self.B_t)
            return selected_outputs(low.gather(1, idx) * weights, idx, self.B_t)
        dense = torch.zeros_like(logits).scatter(1, chosen, gates)   # (T, N)
        return self._adapter_mixture(tokens, low, dense[:, self.unit_of])

    def _adapter_mixture(self, tokens, low, rank_weights):
        if low is None:
            return dense_rank_mixture(tokens, rank_weights, self.A, self.B_t)
        return (low * rank_weights) @ self.B_t


class MergedLora(_LibraryFactors):
    """(Σ λ_n B_n)(Σ λ_n A_n) x over the adapters targeting the layer (equal ranks), λ the
    library-wide weights held by `weights_of()` (one per adapter)."""

    def __init__(self, A, B, owner, weights_of):
        super().__init__(A, B, owner)
        if len(set(self.adapter_ranks)) > 1:
            raise ValueError(f'merging adapters of different ranks {self.adapter_ranks} on one layer')
        self.rank = self.adapter_ranks[0]
        self._weights_of = weights_of   # a callable: a module reference would register twice

    def forward(self, x):
        lam = self._weights_of()[self.adapters].float()
        a = (self.A.view(len(self.adapters), self.rank, -1) * lam[:, None, None]).sum(0)
        b_t = (self.B_t.view(len(self.adapters), self.rank, -1) * lam[:, None, None]).sum(0)
        return self._out(F.linear(_tokens(x, self.in_features), a) @ b_t, x)


class LoraGate(_LibraryFactors):
    """MoLE: every adapter's output E_n(x); gate = softmax(W_g · LN(concat_n E_n(x)) / τ)
    over the layer's adapters; Δh = Σ_n gate_n E_n(x). A layer only one adapter targets has no
    gate (a softmax over one output is 1 whatever W_g is: it would train nothing)."""

    def __init__(self, A, B, owner, temperature: float = 1.0):
        super().__init__(A, B, owner)
        n = len(self.adapters)
        self.gate = nn.Parameter(torch.zeros(n, n * self.out_features)) if n > 1 else None
        self.temperature = temperature

    def forward(self, x):
        tokens = _tokens(x, self.in_features)
        low = F.linear(tokens, self.A)                                   # (T, E)
        n = len(self.adapters)
        outputs = torch.stack([part @ b_t for part, b_t in
                               zip(low.split(self.adapter_ranks, dim=1),
                                   self.B_t.split(self.adapter_ranks))], dim=1)  # (T, n, d_out)
        if self.gate is None:
            return self._out(outputs[:, 0], x)
        flat = F.layer_norm(outputs.reshape(tokens.shape[0], -1), (n * self.out_features,))
        gates = (F.linear(flat, self.gate) / self.temperature).softmax(-1)
        return self._out((gates.unsqueeze(-1) * outputs).sum(1), x)


class FlowGate(nn.Module):
    """LoRA-Flow's gate of one decoder layer: w = softmax(W x_l) + b from the layer's input
    hidden state x_l, one weight per library adapter, shared by the layer's modules."""

    def __init__(self, hidden_size: int, num_adapters: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_adapters, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_adapters))
        self.current = None   # (tokens, num_adapters) for the forward in progress

    def observe(self, hidden: torch.Tensor) -> None:
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        self.current = F.linear(flat, self.weight).softmax(-1) + self.bias


class FlowMixture(_LibraryFactors):
    """LoRA-Flow on one module: Δh = Σ_n w_n E_n(x), w from its decoder layer's FlowGate."""

    def __init__(self, A, B, owner, gate_of):
        super().__init__(A, B, owner)
        self._gate_of = gate_of

    def forward(self, x):
        gates = self._gate_of().current
        tokens = _tokens(x, self.in_features)
        if gates is None or gates.shape[0] != tokens.shape[0]:
            raise RuntimeError('LoRA-Flow: the decoder layer gate did not see this forward')
        return self._out(dense_rank_mixture(tokens, gates[:, self.owner], self.A, self.B_t), x)


def add_library_output(module, args, output):
    return output + getattr(module, LIBRARY_ATTR)(args[0]).to(output.dtype)
