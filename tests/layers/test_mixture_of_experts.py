"""The mixture-of-experts block against per-token references computed by hand, in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from axtorch.config.errors import ConfigError
from axtorch.layers import (
    FeedForwardInput,
    GatedFeedForwardConfig,
    Gating,
    InitConfig,
    LinearConfig,
    MixtureOfExpertsConfig,
    RouterConfig,
)
from axtorch.layers.init import initial_parameter_values

DIM, HIDDEN, EXPERTS = 8, 16, 4


def _moe(top_k=2, dim=DIM, seed=0, **fields):
    router = fields.pop("router", {})
    config = MixtureOfExpertsConfig(
        hidden_dim=HIDDEN, num_experts=EXPERTS, router=RouterConfig(top_k=top_k, **router), **fields
    )
    config.validate("moe")
    module = config.build(dim).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return module


def _tokens(batch=2, seq=5, dim=DIM, seed=1):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _expert(module, index, x):
    """Expert ``index`` on one token, written out: down @ (silu(gate @ x) * (up @ x))."""
    experts = module.experts
    return experts.down_proj[index] @ (F.silu(experts.gate_proj[index] @ x) * (experts.up_proj[index] @ x))


def _gates(module, x):
    """Per token: the chosen experts and their weights, from the router's rule written out."""
    logits = module.router.projection.weight @ x
    config = module.router.config
    scores = logits.softmax(-1) if config.gating is Gating.softmax else logits.sigmoid()
    order = sorted(range(EXPERTS), key=lambda e: -scores[e].item())[: config.top_k]
    weights = [scores[e] for e in order]
    if config.normalize_top_k:
        weights = [w / sum(weights) for w in weights]
    return list(zip(order, weights))


def _reference(module, tokens, kept=lambda token, expert: True):
    """``sum_k weight_k * expert_k(x)`` token by token, leaving out the assignments ``kept`` rejects."""
    flat = tokens.reshape(-1, tokens.shape[-1])
    rows = []
    for t, x in enumerate(flat):
        terms = [w * _expert(module, e, x) for e, w in _gates(module, x) if kept(t, e)]
        rows.append(sum(terms) if terms else torch.zeros_like(x))
    return torch.stack(rows).reshape(tokens.shape)


def test_router_gives_each_token_exactly_top_k_distinct_experts():
    module = _moe(top_k=3)
    routing = module.router(_tokens().reshape(-1, DIM))
    assert routing.experts.shape == routing.weights.shape == (10, 3)
    assert all(len(set(row.tolist())) == 3 for row in routing.experts)
    torch.testing.assert_close(routing.weights.sum(-1), torch.ones(10, dtype=torch.float64))


def test_each_expert_computes_exactly_the_tokens_routed_to_it(monkeypatch):
    module = _moe(top_k=2)
    tokens = _tokens()
    rows_seen = {}
    expert = module.experts.expert

    def recording(index, x):
        rows_seen[index] = len(x)
        return expert(index, x)

    monkeypatch.setattr(module.experts, "expert", recording)
    module(FeedForwardInput(tokens))
    routed = module.router(tokens.reshape(-1, DIM)).experts
    assert rows_seen == {e: int((routed == e).sum()) for e in range(EXPERTS) if (routed == e).any()}
    assert sum(rows_seen.values()) == 10 * 2  # every token exactly top_k times, and no expert runs empty


@pytest.mark.parametrize(
    "router",
    [
        dict(),
        dict(normalize_top_k=False),
        dict(gating=Gating.sigmoid),
        dict(gating=Gating.sigmoid, normalize_top_k=False),
    ],
    ids=["softmax", "softmax-unnormalised", "sigmoid", "sigmoid-unnormalised"],
)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_dropless_equals_a_per_token_reference(router, top_k):
    module = _moe(top_k=top_k, router=router)
    tokens = _tokens()
    torch.testing.assert_close(
        module(FeedForwardInput(tokens)).hidden_states, _reference(module, tokens), rtol=0, atol=1e-12
    )


def test_sigmoid_and_softmax_gates_are_their_functions_of_the_router_logits():
    tokens = _tokens().reshape(-1, DIM)
    for gating, function in ((Gating.softmax, lambda z: z.softmax(-1)), (Gating.sigmoid, torch.sigmoid)):
        module = _moe(top_k=2, router=dict(gating=gating, normalize_top_k=False))
        routing = module.router(tokens)
        scores = function(tokens @ module.router.projection.weight.T)
        torch.testing.assert_close(routing.weights, scores.gather(1, routing.experts), rtol=0, atol=1e-15)
        assert torch.equal(routing.experts, scores.topk(2).indices)
    # Sigmoid scores do not compete: unnormalised, a token's top-k weights need not sum to 1.
    assert not torch.allclose(routing.weights.sum(-1), torch.ones(10, dtype=torch.float64))


def test_a_capacity_large_enough_for_every_assignment_changes_nothing():
    dropless = _moe(top_k=2)
    capped = _moe(top_k=2, capacity_factor=float(EXPERTS))  # capacity = tokens * top_k
    tokens = _tokens()
    assert capped.capacity(10) == 20
    torch.testing.assert_close(
        capped(FeedForwardInput(tokens)).hidden_states,
        dropless(FeedForwardInput(tokens)).hidden_states,
        rtol=0,
        atol=1e-12,
    )


def _forced_routing(first_coordinates):
    """Tokens whose router logits are ``c * [3, 2, -2, -3]``: c > 0 chooses experts 0 and 1, c < 0 experts 3 and 2."""
    module = _moe(top_k=2, capacity_factor=1.0)
    with torch.no_grad():
        module.router.projection.weight.zero_()
        module.router.projection.weight[:, 0] = torch.tensor([3.0, 2.0, -2.0, -3.0])
    tokens = _tokens(batch=2, seq=3)
    tokens[..., 0] = torch.tensor(first_coordinates, dtype=torch.float64).reshape(2, 3)
    return module, tokens


@pytest.mark.parametrize(
    ("capacity_factor", "first_coordinates", "kept"),
    [
        # Every token wants experts 0 and 1; capacity ceil(1.0 * 6 * 2 / 4) = 3 keeps tokens 0-2 on both.
        (1.0, [1, 1, 1, 1, 1, 1], lambda t, e: t < 3),
        # Capacity ceil(0.5 * 6 * 2 / 4) = 2: tokens 0-1.
        (0.5, [1, 1, 1, 1, 1, 1], lambda t, e: t < 2),
        # Token 0 goes to experts 3 and 2, which have room; experts 0 and 1 take tokens 1-3, in token order.
        (1.0, [-1, 1, 1, 1, 1, 1], lambda t, e: t < 4),
        # Token 3 alone goes to experts 3 and 2; experts 0 and 1 fill up with tokens 0-2 and drop 4 and 5.
        (1.0, [1, 1, 1, -1, 1, 1], lambda t, e: t < 4),
    ],
)
def test_capacity_keeps_the_earliest_tokens_and_drops_the_rest(capacity_factor, first_coordinates, kept):
    module, tokens = _forced_routing(first_coordinates)
    module.capacity_factor = capacity_factor
    out = module(FeedForwardInput(tokens)).hidden_states
    torch.testing.assert_close(out, _reference(module, tokens, kept), rtol=0, atol=1e-12)
    dropped = [t for t in range(6) if not kept(t, 0)]
    assert all(torch.equal(out.reshape(6, DIM)[t], torch.zeros(DIM, dtype=torch.float64)) for t in dropped)


@pytest.mark.parametrize("gating", [Gating.softmax, Gating.sigmoid])
def test_auxiliary_losses_are_the_switch_and_z_loss_formulas(gating):
    module = _moe(top_k=2, router=dict(gating=gating, load_balancing_loss_weight=0.3, z_loss_weight=0.7))
    tokens = _tokens().reshape(-1, DIM)
    aux_loss = module(FeedForwardInput(tokens)).aux_loss

    logits = tokens @ module.router.projection.weight.T
    scores = logits.softmax(-1) if gating is Gating.softmax else logits.sigmoid()
    probabilities = scores / scores.sum(-1, keepdim=True)
    chosen = [set(row.topk(2).indices.tolist()) for row in scores]
    fraction = [sum(e in c for c in chosen) / len(chosen) for e in range(EXPERTS)]
    mean_probability = probabilities.mean(0)
    balance = EXPERTS * sum(fraction[e] * mean_probability[e] for e in range(EXPERTS))
    z_loss = sum(math.log(sum(math.exp(z) for z in row.tolist())) ** 2 for row in logits) / len(logits)
    assert aux_loss.item() == pytest.approx(0.3 * balance.item() + 0.7 * z_loss, rel=1e-12)


def test_uniform_router_probabilities_score_top_k_and_zero_weights_give_no_aux_loss():
    module = _moe(top_k=2, router=dict(load_balancing_loss_weight=1.0))
    with torch.no_grad():
        module.router.projection.weight.zero_()  # every P_e = 1 / num_experts, so the loss is sum_e f_e = top_k
    assert module(FeedForwardInput(_tokens())).aux_loss.item() == pytest.approx(2.0, rel=1e-12)
    assert _moe(router=dict(load_balancing_loss_weight=0.0)).forward(FeedForwardInput(_tokens())).aux_loss is None


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_gradients_reach_the_router_through_the_gates_and_the_aux_loss(capacity_factor):
    module = _moe(capacity_factor=capacity_factor, router=dict(load_balancing_loss_weight=0.0))
    module(FeedForwardInput(_tokens())).hidden_states.square().sum().backward()
    assert module.router.projection.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.experts.parameters())

    aux_only = _moe(capacity_factor=capacity_factor, router=dict(load_balancing_loss_weight=1.0, z_loss_weight=1.0))
    aux_only(FeedForwardInput(_tokens())).aux_loss.backward()
    assert aux_only.router.projection.weight.grad.abs().sum() > 0


def test_shared_experts_are_added_scaled_by_their_sigmoid_gate():
    shared = GatedFeedForwardConfig(hidden_dim=12)
    module = _moe(shared_experts=shared, shared_expert_gate=True)
    routed_only = _moe()  # the same seed: the same router and experts
    tokens = _tokens()
    shared_out = module.shared_experts(FeedForwardInput(tokens)).hidden_states
    gate = torch.sigmoid(module.shared_expert_gate(tokens))
    assert gate.shape == (2, 5, 1)
    torch.testing.assert_close(
        module(FeedForwardInput(tokens)).hidden_states,
        routed_only(FeedForwardInput(tokens)).hidden_states + gate * shared_out,
        rtol=0,
        atol=1e-12,
    )


def test_expert_weights_are_stacked_for_expert_sharding_and_initialised_from_their_config():
    config = MixtureOfExpertsConfig(
        hidden_dim=64,
        num_experts=EXPERTS,
        projection=LinearConfig(init=InitConfig(std=0.5)),
        output_projection=LinearConfig(init=InitConfig(std=0.1)),
    )
    with torch.device("meta"):
        module = config.build(32)
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    assert shapes == {
        "router.projection.weight": (EXPERTS, 32),
        "experts.gate_proj": (EXPERTS, 64, 32),
        "experts.up_proj": (EXPERTS, 64, 32),
        "experts.down_proj": (EXPERTS, 32, 64),
    }
    torch.manual_seed(0)
    first = dict(initial_parameter_values(module))
    torch.manual_seed(0)
    second = dict(initial_parameter_values(module))
    assert first.keys() == shapes.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert first["experts.gate_proj"].std().item() == pytest.approx(0.5, rel=0.05)
    assert first["experts.down_proj"].std().item() == pytest.approx(0.1, rel=0.05)
    assert module.active_parameter_count() == EXPERTS * 32 + 3 * 64 * 32 * 2  # router + top 2 of 4 experts


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (dict(num_experts=0), "moe.num_experts"),
        (dict(router=RouterConfig(top_k=5)), "moe.router.top_k"),
        (dict(router=RouterConfig(z_loss_weight=-1.0)), "moe.router.z_loss_weight"),
        (dict(projection=LinearConfig(bias=True)), "moe.projection.bias"),
        (dict(capacity_factor=0.0), "moe.capacity_factor"),
        (dict(shared_expert_gate=True), "moe.shared_expert_gate"),
        (dict(shared_experts=GatedFeedForwardConfig(hidden_dim=0)), "moe.shared_experts.hidden_dim"),
    ],
)
def test_config_errors_name_the_key(change, key):
    config = MixtureOfExpertsConfig(**{"hidden_dim": HIDDEN, "num_experts": EXPERTS, **change})
    with pytest.raises(ConfigError, match=rf"invalid config {key}="):
        config.validate("moe")
