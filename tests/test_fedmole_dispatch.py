"""Fed-MoLE's grouped expert dispatch (experts' matmuls batched over blocks of one expert's
tokens) gives the outputs and gradients of the previous per-expert Python loop."""
import functools

import pytest
import torch
from test_fedmole import build_clients, load

from fs_plugins.tuners.mole import MoleConfig, RoutedLoraExperts
from fs_plugins.tuners.mole.layer import ExpertBlocks, per_expert_loop

D_IN, D_OUT = 12, 10


def random_layer(n, k, router_std=1.0, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    layer = RoutedLoraExperts(D_IN, D_OUT, MoleConfig(num_experts=n, top_k=k, r=4, alpha=8,
                                                      dropout=dropout))
    with torch.no_grad():   # B = 0 at init would make every output 0; std 0.1 keeps outputs
        layer.expert_B.normal_(std=0.1)  # and gradients O(1), where atol 1e-6 is ~10 ulp
        layer.router.normal_(std=router_std) if router_std else layer.router.zero_()
    return layer


def outputs_and_grads(forward, layer, x, seed=0):
    """forward(x), and the gradients of a fixed random projection of it w.r.t. x and every
    parameter (None where a parameter gets none)."""
    torch.manual_seed(seed)             # same dropout masks for both dispatches
    out = forward(x)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    inputs = [x, *layer.parameters()]
    return out, torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)


def assert_same_as_loop(layer, x):
    got, got_grads = outputs_and_grads(layer, layer, x)
    want, want_grads = outputs_and_grads(functools.partial(per_expert_loop, layer), layer, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ['x', *(name for name, _ in layer.named_parameters())]
    for name, g, w in zip(names, got_grads, want_grads):
        assert (g is None) == (w is None), name
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f'{n}: {m}')


@pytest.mark.parametrize('n,k,shape', [
    (6, 2, (3, 7)),
    (8, 1, (2, 5)),
    (4, 4, (1, 9)),      # every token to every expert
    (64, 2, (4, 32)),
    (64, 2, (1, 3)),     # 6 assignments: most experts receive no token
    (16, 3, (37,)),      # flat tokens, no batch dimension
])
def test_grouped_dispatch_equals_the_per_expert_loop(n, k, shape):
    layer = random_layer(n, k)
    assert_same_as_loop(layer, torch.randn(*shape, D_IN, requires_grad=True))


def test_skewed_routing_spreads_one_expert_over_several_blocks():
    """Expert 0 takes every token, the others share the second slot: expert 0 needs several
    blocks, and the dispatch must still match the loop."""
    layer = random_layer(8, 2, router_std=0.3)
    with torch.no_grad():
        layer.router[:, 0] = 0
        layer.router[0] = 0
        layer.router[0, 0] = 1.0         # expert 0's logit is x[0] = 50, far above the others
    x = torch.randn(2, 20, D_IN)
    x[..., 0] = 50.0
    experts, _ = layer.route(x.reshape(-1, D_IN))
    assert (experts[:, 0] == 0).all()
    assert (ExpertBlocks(experts, layer.num_experts).expert_of_block == 0).sum() > 1
    assert_same_as_loop(layer, x.requires_grad_())


@pytest.mark.parametrize('n,k', [(5, 2), (64, 2), (8, 8)])
def test_blocks_hold_each_assignment_once_and_one_expert_each(n, k):
    torch.manual_seed(n)
    experts = torch.randn(50, n).topk(k, dim=-1).indices
    blocks = ExpertBlocks(experts, n)
    num_assignments = experts.numel()
    rows = blocks.assignment_of_row
    real = rows[rows < num_assignments]
    assert sorted(real.tolist()) == list(range(num_assignments))
    expert_of_row = blocks.expert_of_block.repeat_interleave(blocks.size)
    assert torch.equal(experts.reshape(-1)[real], expert_of_row[rows < num_assignments])
    assert torch.equal(blocks.token_of_row[rows < num_assignments], real // k)
    assert (blocks.token_of_row[rows == num_assignments] == 50).all()   # padding's row
    assert rows.numel() <= 1.5 * num_assignments          # padding: at most half
    counts = torch.bincount(experts.reshape(-1), minlength=n)
    assert set(blocks.expert_of_block.tolist()) == set(counts.nonzero().reshape(-1).tolist())


def test_all_zero_router_ties_are_broken_the_same_way():
    """router_init_std 0: every logit ties, the router's top-K picks the experts for both."""
    layer = random_layer(8, 2, router_std=0)
    assert_same_as_loop(layer, torch.randn(3, 4, D_IN, requires_grad=True))


def test_bfloat16_input_with_float32_adapters():
    layer = random_layer(16, 2)
    x = torch.randn(2, 9, D_IN).to(torch.bfloat16).requires_grad_()
    assert layer(x).dtype == torch.float32
    assert_same_as_loop(layer, x)


def test_dropout_masks_are_the_loops():
    layer = random_layer(8, 2, dropout=0.3)
    layer.train()
    assert_same_as_loop(layer, torch.randn(2, 11, D_IN, requires_grad=True))


def test_no_tokens_gives_an_empty_output():
    layer = random_layer(8, 2)
    out = layer(torch.randn(2, 0, D_IN))
    assert out.shape == (2, 0, D_OUT)


def test_tiny_model_with_padded_batch_matches_the_loop(tmp_path):
    """Whole tiny model (MoLE on up_proj of both layers), a batch with padding tokens: same
    loss and same gradients for every trainable parameter with either dispatch."""
    proc = build_clients(load(tmp_path, num_experts=16, top_k=2))[1]
    model = proc.model
    layers = [m for m in model.modules() if isinstance(m, RoutedLoraExperts)]
    with torch.no_grad():
        for layer in layers:
            layer.expert_B.normal_(std=0.1)
    proc.begin_round()
    batch = {key: value.clone() for key, value in proc.next_batch().items()}
    pad_id = model.config.pad_token_id or 0
    batch['input_ids'][0, -4:] = pad_id            # right-pad the first sequence
    batch['attention_mask'][0, -4:] = 0
    batch['labels'][0, -4:] = -100
    model.eval()                                  # no dropout: both passes see the same masks
    params = [proc.params[n].requires_grad_() for n in proc.trainable_names]   # both phases'

    def loss_and_grads():
        loss = model(**batch).loss
        return loss, torch.autograd.grad(loss, params)
    grouped_loss, grouped_grads = loss_and_grads()
    for layer in layers:
        layer.forward = functools.partial(per_expert_loop, layer)
    loop_loss, loop_grads = loss_and_grads()
    torch.testing.assert_close(grouped_loss, loop_loss, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(proc.trainable_names, grouped_grads, loop_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f'{n}: {m}')
