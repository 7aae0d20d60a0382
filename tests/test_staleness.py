"""Staleness-aware weights: the formulas, the engine's weighted rounds on exact arithmetic, the strategies' side."""

from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig
from lightning_partial.collectives.staleness import StalenessWeights
from lightning_partial.strategies import compensation

from distributed import run_threads

P = 4


# ------------------------------------------------------------------ the rules
def test_weights_and_spike_follow_the_documented_formulas():
    momentum = StalenessWeights(rule="momentum", momentum=0.9)
    assert [momentum.weight(t) for t in range(4)] == [1.0, 0.9, 0.9**2, 0.9**3]
    assert momentum.spike(0) == 0.0
    for tau in (1, 2, 5):
        assert math.isclose(momentum.spike(tau), sum(0.9**k for k in range(tau)))
    damped = StalenessWeights(rule="momentum", momentum=0.5, dampening=0.5)
    assert damped.spike(2) == 0.5 * (1 + 0.5)
    inverse = StalenessWeights(rule="inverse")
    assert [inverse.weight(t) for t in range(4)] == [1.0, 1 / 2, 1 / 3, 1 / 4]
    assert inverse.spike(3) == 0.0
    none = StalenessWeights()
    assert not none.active and none.weight(100) == 1.0 and none.spike(100) == 0.0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(rule="fancy"), "unknown staleness rule 'fancy'"),
        (dict(rule="momentum"), "needs the optimizer's momentum"),
        (dict(rule="momentum", momentum=-0.1), r"momentum must be in \[0, 1\)"),
        (dict(rule="momentum", momentum=1.0), r"momentum must be in \[0, 1\)"),
        (dict(rule="momentum", momentum=float("nan")), "momentum must be a finite number"),
        (dict(rule="momentum", momentum=float("inf")), "momentum must be a finite number"),
        (dict(rule="momentum", momentum=0.9, dampening=-1.0), "dampening"),
        (dict(rule="momentum", momentum="0.9"), "momentum must be a finite number"),
        (dict(rule="inverse", momentum=0.9), "only meaningful with rule 'momentum'"),
    ],
)
def test_bad_weights_fail_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        StalenessWeights(**kw)


def test_engine_refuses_weights_on_integer_tensors():
    store = dist.HashStore()
    cfg = PartialAllreduceConfig(staleness=StalenessWeights(rule="inverse"))
    with pytest.raises(ValueError, match="every tensor must be floating point"):
        PartialAllreduce(cfg, store=store, rank=0, world_size=1, like=[torch.zeros(3, dtype=torch.int64)])


def test_engine_config_refuses_a_non_weights_staleness():
    with pytest.raises(ValueError, match="staleness must be a StalenessWeights"):
        PartialAllreduceConfig(staleness="momentum")  # type: ignore[arg-type]


# --------------------------------------------------------- the engine, exact
def _weighted_rounds(weights: StalenessWeights, steps: int, dtype: torch.dtype = torch.float64):
    """4 ranks (threads), solo, rank 1 slow in every step so that its gradients are carried."""
    cfg = PartialAllreduceConfig(
        mode="solo", normalize="sum", staleness=weights, timeout=timedelta(seconds=30),
        setup_timeout=timedelta(seconds=120),
    )

    def grad(rank: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(rank * 100003 + step)
        return torch.randint(-1000, 1000, (6,), generator=g).to(dtype)

    def fn(rank: int, store: dist.Store):
        engine = PartialAllreduce(cfg, store=store, rank=rank, world_size=P, like=torch.zeros(6, dtype=dtype))
        engine.start()
        results = []
        try:
            for step in range(steps):
                if rank == 1:
                    time.sleep(0.006)
                results.append(engine.arrive(grad(rank, step)))
            results.append(engine.flush())
        finally:
            engine.close()
        return results

    return run_threads(P, fn), grad


@pytest.mark.parametrize(
    "weights",
    [StalenessWeights(rule="momentum", momentum=0.5), StalenessWeights(rule="inverse")],
    ids=["momentum", "inverse"],
)
def test_weighted_rounds_are_exact_identical_and_account_for_what_they_withhold(weights):
    """Each round is sum_i sum_q weight(r - q) g_i(q); the rest is RoundStats.discounted; replicas identical."""
    steps = 60
    per_rank, grad = _weighted_rounds(weights, steps)
    results = per_rank[0]
    for other in per_rank[1:]:
        for a, b in zip(results, other):
            assert torch.equal(a.tensors[0], b.tensors[0]), f"round {a.round_index} differs between ranks"
            assert a.stats.discounted == b.stats.discounted and a.stats.counts == b.stats.counts
    withheld_total = torch.zeros(6, dtype=torch.float64)
    stale_rounds = 0
    for result in results:
        r, s = result.round_index, result.stats
        expected = torch.zeros(6, dtype=torch.float64)
        for i in range(P):
            if not s.counts[i]:
                assert s.discounted[i] == 0.0
                continue
            newest, oldest = r - s.staleness[i], r - s.oldest_staleness[i]
            assert s.counts[i] == newest - oldest + 1  # a rank's carried gradients are consecutive steps
            withheld = 0.0
            for q in range(oldest, newest + 1):
                w = weights.weight(r - q)
                expected += w * grad(i, q)
                withheld += 1.0 - w
                withheld_total += (1.0 - w) * grad(i, q)
            if weights.rule == "momentum":  # dyadic weights: the fixed-point count is exact
                assert s.discounted[i] == withheld, f"round {r}, rank {i}"
            else:
                assert math.isclose(s.discounted[i], withheld, abs_tol=1e-6)
        stale_rounds += s.max_staleness > 0
        if weights.rule == "momentum":
            assert torch.equal(result.tensors[0], expected), f"round {r}"
        else:
            torch.testing.assert_close(result.tensors[0], expected, rtol=0, atol=1e-9)
    assert stale_rounds > 5, "rank 1 was never late: the test proves nothing"
    # Nothing lost silently: applied + withheld = everything computed.
    arrived = sum(grad(i, q) for i in range(P) for q in range(steps))
    applied = sum(r.tensors[0] for r in results)
    torch.testing.assert_close(applied + withheld_total, arrived, rtol=0, atol=1e-8)
    assert sum(r.stats.contributions for r in results) == P * steps
    assert sum(r.stats.discounted_total for r in results) > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_rule_none_leaves_rounds_whole(dtype):
    """Carried gradients summed unweighted (integer buffers too: no float factor touches them)."""
    per_rank, grad = _weighted_rounds(StalenessWeights(), 30, dtype)
    results = per_rank[0]
    arrived = sum(grad(i, q) for i in range(P) for q in range(30))
    assert torch.equal(sum(r.tensors[0] for r in results), arrived)
    assert all(d == 0.0 for r in results for d in r.stats.discounted)
    assert any(c > 1 for r in results for c in r.stats.counts), "no rank carried two gradients into a round"


# ----------------------------------------------------- the strategies' side
def _params(n: int = 2, device: str = "cpu") -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64, device=device)) for _ in range(n)]


#: The host, and a CUDA device where there is one (selected by ``-m cuda``, skipped without a GPU).
DEVICES = ["cpu", pytest.param("cuda", id="cuda", marks=(
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")))]


@pytest.mark.parametrize(
    "make, rule, spike, expected",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "auto", False, ("inverse", 0.0, 0.0)),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "momentum", False, ("momentum", 0.9, 0.0)),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "auto", True, ("momentum", 0.9, 0.1)),
        (lambda p: torch.optim.SGD(p, lr=0.1), "auto", False, ("none", 0.0, 0.0)),
        (lambda p: torch.optim.SGD(p, lr=0.1), "auto", True, ("none", 0.0, 0.0)),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), "auto", False, ("inverse", 0.0, 0.0)),
        (lambda p: torch.optim.AdamW(p, lr=1e-3), "momentum", False, ("momentum", 0.9, 0.0)),
        # abs_sgd re-times whole late results through Adam's and AdamW's own update (retime_adam).
        (lambda p: torch.optim.AdamW(p, lr=1e-3), "auto", True, ("momentum", 0.9, 0.0)),
        (lambda p: torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.99)), "momentum", True, ("momentum", 0.8, 0.0)),
        (lambda p: torch.optim.NAdam(p, lr=1e-3), "auto", True, ("none", 0.0, 0.0)),
        (lambda p: torch.optim.SGD(p, lr=0.1), "inverse", False, ("inverse", 0.0, 0.0)),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "none", True, ("none", 0.0, 0.0)),
        (lambda p: torch.optim.Adagrad(p, lr=0.1), "auto", True, ("none", 0.0, 0.0)),
        # RMSprop's momentum is not SGD's: weights for eager_sgd, no spike compensation for abs_sgd.
        (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9), "auto", False, ("inverse", 0.0, 0.0)),
        (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9), "auto", True, ("none", 0.0, 0.0)),
        # "auto" for eager_sgd needs no single coefficient: groups may differ.
        (
            lambda p: torch.optim.SGD([{"params": p[:1], "momentum": 0.9}, {"params": p[1:], "momentum": 0.0}], lr=0.1),
            "auto", False, ("inverse", 0.0, 0.0),
        ),
    ],
)
def test_rule_resolved_from_the_optimizer(make, rule, spike, expected):
    weights = compensation.resolve(rule, make(_params()), owner="test", spike=spike)
    assert (weights.rule, weights.momentum, weights.dampening) == expected


@pytest.mark.parametrize(
    "make, rule, spike, match",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), "momentum", False, "needs an optimizer with momentum"),
        (lambda p: torch.optim.NAdam(p, lr=1e-3), "momentum", True,
         "needs torch.optim.SGD with momentum, torch.optim.Adam or torch.optim.AdamW, not NAdam"),
        (lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9), "momentum", True, "needs torch.optim.SGD"),
        (
            lambda p: torch.optim.SGD([{"params": p[:1], "momentum": 0.9}, {"params": p[1:], "momentum": 0.5}], lr=0.1),
            "momentum", False, "one momentum coefficient for all parameter groups",
        ),
    ],
)
def test_rule_the_optimizer_cannot_serve_is_refused_naming_the_option(make, rule, spike, match):
    with pytest.raises(ValueError, match=match):
        compensation.resolve(rule, make(_params()), owner="test", spike=spike)


@pytest.mark.parametrize("rule", ["fancy", "", None, 3])
def test_unknown_strategy_rule_is_refused(rule):
    with pytest.raises(ValueError, match="unknown staleness_rule"):
        compensation.check_rule(rule, owner="eager_sgd")


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("tau", [1, 2, 3])
def test_spike_compensation_reproduces_the_on_time_trajectory_of_a_late_gradient(tau, nesterov):
    """SGD momentum 0.5 (exact in binary): a gradient applied tau rounds late with weight mu**tau through the
    optimizer and the spike outside it moves the parameter exactly as on time, from the round it arrives on."""
    mu, lr, rounds = 0.5, 0.25, 12
    g = torch.tensor([8.0, -4.0, 2.0], dtype=torch.float64)
    weights = StalenessWeights(rule="momentum", momentum=mu)

    def trajectory(delay: int, compensate: bool) -> list[torch.Tensor]:
        (p,) = _params(1)
        opt = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=nesterov)
        seen = []
        for r in range(rounds):
            grad = torch.zeros_like(g)
            if r == delay:
                grad = g * (weights.weight(delay) if compensate else 1.0)
            p.grad = grad.clone()
            opt.step()
            if r == delay and compensate:
                compensation.apply_spike(opt, [p], [g], weights.spike(delay))
            seen.append(p.detach().clone())
        return seen

    on_time = trajectory(0, compensate=False)
    late = trajectory(tau, compensate=True)
    uncompensated = trajectory(tau, compensate=False)
    for r in range(tau, rounds):
        assert torch.equal(late[r], on_time[r]), f"round {r}"
    # Without compensation the late gradient overshoots the on-time total: 1 / (1 - mu) of it, all late.
    assert not torch.equal(uncompensated[-1], on_time[-1])


def test_spike_follows_each_groups_learning_rate_and_maximize():
    a, b = _params(2)
    opt = torch.optim.SGD([{"params": [a], "lr": 0.5}, {"params": [b], "lr": 0.25, "maximize": True}], lr=1.0)
    g = torch.ones(3, dtype=torch.float64)
    compensation.apply_spike(opt, [a, b], [g, g], 2.0)
    assert torch.equal(a.detach(), torch.full((3,), -1.0, dtype=torch.float64))
    assert torch.equal(b.detach(), torch.full((3,), 0.5, dtype=torch.float64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adam", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("tau", [1, 2, 3])
def test_adam_retiming_leaves_the_on_time_first_moment_and_applies_the_owed_share(adam, tau, device):
    """betas (0.5, 0.75), exact in binary: a gradient that arrives tau rounds late leaves in exp_avg what the
    on-time trajectory holds tau rounds on, (1 - b1) b1^tau g, and moves the weights by the documented plain step
    (the owed 1 - b1^tau, less what the step applied through the moment), at the step's own scale."""
    b1, b2, lr, eps = 0.5, 0.75, 0.25, 1e-8
    g = torch.tensor([8.0, -4.0, 2.0], dtype=torch.float64, device=device)

    def run(delay: int, compensate: bool) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, torch.Tensor]:
        (p,) = _params(1, device)
        opt = adam([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
        stepped = p.detach().clone()
        for r in range(delay + 1):
            p.grad = g.clone() if r == delay else torch.zeros_like(g)
            stepped = p.detach().clone()
            opt.step()
            stepped = p.detach().clone()
        if compensate:
            compensation.retime_adam(opt, [p], [g], tau)
        return p, opt, stepped

    on_time, on_opt, _ = run(0, compensate=False)
    # On time, tau rounds later (zero gradients since): the moment holds (1 - b1) b1^tau g.
    for _ in range(tau):
        on_time.grad = torch.zeros_like(g)
        on_opt.step()
    late, late_opt, after_step = run(tau, compensate=True)
    assert torch.equal(late_opt.state[late]["exp_avg"], on_opt.state[on_time]["exp_avg"])
    assert torch.equal(late_opt.state[late]["exp_avg"], (1 - b1) * b1**tau * g)
    t = tau + 1
    denom = (late_opt.state[late]["exp_avg_sq"] / (1 - b2**t)).sqrt() + eps
    expected = after_step - lr / (1 - b1**t) * b1 * (1 - b1**tau) * g / denom
    assert torch.allclose(late.detach(), expected, rtol=1e-15, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_retiming_in_bfloat16_is_the_float32_formula_rounded_once(device):
    """bfloat16 weights and state (Adam keeps the parameter's dtype): the quotient is taken in float32 and
    rounded once into the weights; the moment's correction is the gradient's share in the moment's dtype.
    (Not float16: Adam's own step there turns NaN where eps = 1e-8 underflows.)"""
    dtype = torch.bfloat16
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, device=device).to(dtype))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    g = torch.randn(64, device=device).to(dtype)
    p.grad = g.clone()
    opt.step()
    stepped, moment = p.detach().clone(), opt.state[p]["exp_avg"].clone()
    second, t = opt.state[p]["exp_avg_sq"].float(), float(opt.state[p]["step"])
    compensation.retime_adam(opt, [p], [g], 2)
    owed = 1 - 0.9**2
    assert torch.equal(opt.state[p]["exp_avg"], moment.add(g, alpha=-(1 - 0.9) * owed))
    step = g.float() / ((second / (1 - 0.999**t)).sqrt() + 1e-8) * (1e-2 * 0.9 * owed / (1 - 0.9**t))
    assert torch.equal(p.detach(), stepped - step.to(dtype))
    assert torch.isfinite(p.detach()).all() and not torch.equal(p.detach(), stepped)


def test_adam_retiming_follows_maximize_amsgrad_and_skips_parameters_without_state():
    a, b, c = _params(3)
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "maximize": True, "amsgrad": True}, {"params": [c]}],
                            lr=0.25, betas=(0.5, 0.75), weight_decay=0.0)
    g = torch.tensor([8.0, -4.0, 2.0], dtype=torch.float64)
    for scale in (1.0, 0.25):  # a falling gradient: amsgrad's max_exp_avg_sq then exceeds exp_avg_sq
        a.grad, b.grad = scale * g, scale * g
        opt.step()  # c has no gradient: no state
    late = 0.25 * g
    stepped = [x.detach().clone() for x in (a, b, c)]
    moments = [opt.state[x]["exp_avg"].clone() for x in (a, b)]
    second_b = opt.state[b]["max_exp_avg_sq"]
    assert torch.all(second_b > opt.state[b]["exp_avg_sq"])
    compensation.retime_adam(opt, [a, b, c], [late, late, late], 1)
    # Descent moves against g, ascent (maximize) with it; the moment keeps its own sign convention.
    assert torch.all((a.detach() - stepped[0]) * g < 0) and torch.all((b.detach() - stepped[1]) * g > 0)
    assert torch.equal(opt.state[a]["exp_avg"], moments[0] - 0.25 * late)
    assert torch.equal(opt.state[b]["exp_avg"], moments[1] + 0.25 * late)
    assert torch.equal(c.detach(), stepped[2]) and c not in opt.state
    # The documented step, with amsgrad's max_exp_avg_sq as v (t = 2: bias corrections of two steps).
    for x, v, sign in ((a, opt.state[a]["exp_avg_sq"], -1.0), (b, second_b, 1.0)):
        expected = stepped[0 if x is a else 1] + sign * 0.25 / (1 - 0.5**2) * 0.5 * 0.5 * late / (
            (v / (1 - 0.75**2)).sqrt() + 1e-8)
        assert torch.allclose(x.detach(), expected, rtol=1e-15, atol=0)


def test_compensate_dispatches_by_optimizer_and_sgd_keeps_its_plain_step():
    (p,) = _params(1)
    weights = StalenessWeights(rule="momentum", momentum=0.5)
    sgd = torch.optim.SGD([p], lr=0.25, momentum=0.5)
    assert compensation.gradient_weight(sgd, weights, 1) == 0.5
    g = torch.ones(3, dtype=torch.float64)
    compensation.compensate(sgd, weights, [p], [0.5 * g], 1)  # grads as stepped: weight * g
    assert torch.equal(p.detach(), torch.full((3,), -0.25, dtype=torch.float64))  # lr * spike(1) * g
    (q,) = _params(1)
    adam = torch.optim.Adam([q], lr=0.25, betas=(0.5, 0.75))
    assert compensation.gradient_weight(adam, weights, 1) == 1.0
    assert compensation.gradient_weight(adam, StalenessWeights(rule="inverse"), 1) == 0.5
    compensation.compensate(adam, StalenessWeights(), [q], [g], 1)  # rule "none": nothing
    assert torch.equal(q.detach(), torch.zeros(3, dtype=torch.float64))
    # Under "momentum", Adam reaches retime_adam: the same moves as calling it directly on a twin.
    (r,) = _params(1)
    twin = torch.optim.Adam([r], lr=0.25, betas=(0.5, 0.75))
    q.grad, r.grad = g.clone(), g.clone()
    adam.step()
    twin.step()
    compensation.compensate(adam, weights, [q], [g], 1)
    compensation.retime_adam(twin, [r], [g], 1)
    assert torch.equal(q.detach(), r.detach()) and not torch.equal(adam.state[q]["exp_avg"], (1 - 0.5) * g)
    assert torch.equal(adam.state[q]["exp_avg"], twin.state[r]["exp_avg"])
    # A subclass of Adam may step otherwise: "auto" gives it "none", and "momentum" is refused.

    class Custom(torch.optim.Adam):
        pass

    assert compensation.resolve("auto", Custom([r]), owner="abs_sgd", spike=True).rule == "none"
    with pytest.raises(ValueError, match="not Custom"):
        compensation.resolve("momentum", Custom([r]), owner="abs_sgd", spike=True)
