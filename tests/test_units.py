"""The pure logic, without ranks: tensor layouts (the fast tier, see conftest.py).

Nothing here builds a process group or starts a thread: these tests pin the
pieces every round relies on, in well under a second each.
"""

from __future__ import annotations

import pytest
import torch

from lightning_partial.collectives.layout import TensorLayout
from lightning_partial.strategies.accumulation import ACCUMULATED_KEY, RoundAccumulator
from lightning_partial.strategies.adaptive_scaling import GlobalBatchScaling, resolve
from lightning_partial.strategies.prediction import WeightPrediction


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=g, dtype=torch.float64),
        torch.arange(5, dtype=torch.int64),
        torch.randn(2, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 2, generator=g, dtype=torch.float32),
    ]


def test_layout_groups_by_dtype_in_first_seen_order_and_round_trips_exactly():
    ts = tensors()
    layout = TensorLayout(ts, tail=3)
    assert [b.dtype for b in layout.buckets] == [torch.float64, torch.int64, torch.float32]
    assert [b.indices for b in layout.buckets] == [(0, 2), (1,), (3,)]
    assert [b.capacity for b in layout.buckets] == [14 + 3, 5, 2]  # the tail rides in the first bucket only
    flats = layout.flatten(ts)
    layout.tail_of(flats).fill_(7.0)
    back = layout.unflatten(flats)
    assert len(back) == len(ts)
    for a, b in zip(ts, back):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
    # data() and from_data() never carry the tail: a checkpoint of the data restores it with a zero tail.
    assert [d.numel() for d in layout.data(flats)] == [14, 5, 2]
    restored = layout.from_data(layout.data(flats))
    assert torch.equal(layout.tail_of(restored), torch.zeros(3, dtype=torch.float64))
    for a, b in zip(ts, layout.unflatten(restored)):
        assert torch.equal(a, b)


def test_unflatten_gives_views_of_the_buffers():
    ts = tensors()
    layout = TensorLayout(ts)
    flats = layout.flatten(ts)
    layout.unflatten(flats)[2].fill_(-1.0)
    assert torch.equal(flats[0][12:14], torch.tensor([-1.0, -1.0], dtype=torch.float64))


@pytest.mark.parametrize(
    "change",
    [
        lambda ts: ts[:-1],
        lambda ts: [ts[0].reshape(4, 3)] + ts[1:],
        lambda ts: [ts[0].float()] + ts[1:],
    ],
    ids=["fewer tensors", "another shape", "another dtype"],
)
def test_a_changed_layout_is_refused_naming_rank_and_round(change):
    ts = tensors()
    layout = TensorLayout(ts)
    layout.check(ts, rank=2, round_index=9)  # the same tensors pass
    with pytest.raises(ValueError, match=r"rank 3, round 17: the tensors changed since the first round"):
        layout.check(change(ts), rank=3, round_index=17)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: TensorLayout([]), "at least one tensor"),
        (lambda: TensorLayout([torch.zeros(2), [1.0]]), "tensor 1 is a list"),
        (lambda: TensorLayout([torch.zeros(2)], tail=-1), "tail must be >= 0"),
    ],
    ids=["no tensors", "not a tensor", "negative tail"],
)
def test_bad_layouts_fail_at_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_recycled_buffer_sets_are_reused_and_the_pool_is_bounded():
    ts = tensors()
    layout = TensorLayout(ts, max_free=2)
    first = layout.flatten(ts)
    assert layout.allocations == 1
    layout.recycle(first)
    second = layout.flatten(ts)
    assert layout.allocations == 1 and all(a is b for a, b in zip(first, second))  # a pool hit allocates nothing
    sets = [layout.zeros() for _ in range(3)]
    assert layout.allocations == 4
    assert all(torch.count_nonzero(f) == 0 for s in sets for f in s)
    for s in sets + [second]:
        layout.recycle(s)
    for _ in range(3):  # at most max_free sets were kept: two hits, then a miss
        layout.take()
    assert layout.allocations == 5


def test_weight_prediction_predicts_restores_and_keeps_the_update_exactly():
    """begin/predicted/finish: the weights are w + u inside, exactly w after, and u becomes w_after - w_before;
    two buffers serve every step (the copy becomes the update, the old update the next copy)."""
    params = [torch.tensor([1.0, 2.0]), torch.tensor([0.1])]
    prediction = WeightPrediction()
    before = prediction.begin(0, params)
    with prediction.predicted(0, params, before):
        assert torch.equal(params[0], torch.tensor([1.0, 2.0]))  # no update yet: nothing predicted
    params[0].sub_(0.3)
    params[1].add_(0.7)  # "the optimizer step"
    prediction.finish(0, params, before)
    update = prediction.update(0)
    assert torch.equal(update[0], torch.tensor([1.0, 2.0]) - 0.3 - torch.tensor([1.0, 2.0]))
    assert torch.equal(update[1], torch.tensor([0.1]) + 0.7 - torch.tensor([0.1]))
    w = [p.clone() for p in params]
    second = prediction.begin(0, params)
    with prediction.predicted(0, params, second):
        assert all(torch.equal(p, x + u) for p, x, u in zip(params, w, update))
    assert all(torch.equal(p, x) for p, x in zip(params, w))  # restored exactly, not by subtraction
    prediction.finish(0, params, second)
    assert prediction.begin(0, params) is before  # the first copy became the update, now the next copy


def test_weight_prediction_predicts_w_plus_u_bit_for_bit_from_the_negated_update():
    """The update is kept as ``w_before - w_after`` (one pass); the predicted weights are still exactly
    ``w + (w_after - w_before)`` as the two-pass form computed them, on values whose rounding differs."""
    generator = torch.Generator().manual_seed(0)
    w_before = [torch.randn(1000, generator=generator) * 10.0 ** torch.randint(-8, 8, (1000,), generator=generator)]
    prediction = WeightPrediction()
    before = prediction.begin(0, w_before)
    params = [w_before[0] - torch.randn(1000, generator=generator) * 1e-3]  # "the step"
    prediction.finish(0, params, before)
    u = params[0] - w_before[0]  # the two-pass form: (-w_before) + w_after
    bits = lambda t: t.view(torch.int32)  # noqa: E731 - torch.equal on floats would accept -0.0 for 0.0
    assert torch.equal(bits(prediction.update(0)[0]), bits(u))
    w = params[0].clone()
    with prediction.predicted(0, params, prediction.begin(0, params)):
        assert torch.equal(bits(params[0]), bits(w + u))
    assert torch.equal(bits(params[0]), bits(w))


def test_weight_prediction_survives_a_checkpoint_but_not_another_model():
    params = {0: [torch.zeros(2), torch.zeros(1)]}
    prediction = WeightPrediction()
    before = prediction.begin(0, params[0])
    params[0][0].add_(1.0)
    prediction.finish(0, params[0], before)
    checkpoint: dict = {}
    prediction.save(checkpoint)
    resumed = WeightPrediction()
    resumed.load(checkpoint)
    resumed.reset(params)
    assert torch.equal(resumed.update(0)[0], torch.ones(2))
    other = WeightPrediction()
    other.load(checkpoint)
    other.reset({0: [torch.zeros(3)]})  # another model's shapes: nothing predicted
    assert other.update(0) is None
    loaded_elsewhere = WeightPrediction()
    loaded_elsewhere.load(checkpoint)
    loaded_elsewhere.forget_loaded()  # a checkpoint loaded to validate, not to fit
    loaded_elsewhere.reset(params)
    assert loaded_elsewhere.update(0) is None


def test_round_accumulator_steps_once_per_global_batch_on_the_rounds_sum():
    """step_samples=8 with reference_samples=8: rounds of 3, 3 and 4 samples make one step whose gradient is
    the sum of their results (each already a sum over 8), exactly; the next step reuses the buffers."""
    accumulator = RoundAccumulator(step_samples=8, reference_samples=8)
    results = [[torch.tensor([0.5, -1.0]), torch.tensor([0.25])],
               [torch.tensor([0.125, 2.0]), torch.tensor([-0.5])],
               [torch.tensor([1.0, 0.75]), torch.tensor([0.0625])]]
    due = [accumulator.add(0, r, divisor=8.0, samples=n) for r, n in zip(results, (3, 3, 4))]
    assert due == [False, False, True] and accumulator.pending(0) == 3
    gradient = accumulator.take(0)
    expected = [sum(r[i] for r in results) for i in range(2)]
    assert all(torch.equal(g, e) for g, e in zip(gradient, expected))
    assert accumulator.steps(0) == 1 and accumulator.pending(0) == 0
    accumulator.add(0, results[0], divisor=8.0, samples=8)
    assert accumulator.take(0) is gradient  # the last step's buffers hold the next sum
    with pytest.raises(RuntimeError, match="no round was added"):
        accumulator.take(0)


def test_round_accumulator_ends_a_step_at_the_round_nearest_to_step_samples():
    """boundary="nearest" (the default): a step ends at the round after which one more round of the same size
    would overshoot step_samples by at least as much as stopping falls short; "at_least" waits to reach them.
    The decision reads only the round's (global) samples, so every rank steps at the same rounds."""
    one = [torch.tensor([1.0])]
    nearest, at_least = RoundAccumulator(step_samples=8, reference_samples=8), \
        RoundAccumulator(step_samples=8, reference_samples=8, boundary="at_least")
    # 6 of 8: stopping falls short by 2, another round of 6 would overshoot by 4: step now (at_least: wait).
    assert nearest.add(0, one, divisor=8.0, samples=6) and not at_least.add(0, one, divisor=8.0, samples=6)
    assert at_least.add(0, one, divisor=8.0, samples=6) and at_least.take(0)[0].item() == 2.0  # 12 samples, 2 rounds
    assert nearest.take(0)[0].item() == 1.0 and nearest.steps(0) == 1
    # 5 of 8: short by 3, one more round of 5 overshoots by 2: wait. A tie (6, then a round of 4: short by 2, over
    # by 2) steps.
    assert not nearest.add(0, one, divisor=8.0, samples=5)
    assert nearest.add(0, one, divisor=8.0, samples=3) and nearest.take(0)[0].item() == 2.0
    assert not nearest.add(0, one, divisor=8.0, samples=2) and nearest.add(0, one, divisor=8.0, samples=4)
    # Whatever the boundary, nothing is left out: each step's sum holds every round added since the last.
    assert nearest.take(0)[0].item() == 2.0 and nearest.pending(0) == 0
    with pytest.raises(ValueError, match="RoundAccumulator: unknown step_boundary 'round'"):
        RoundAccumulator(step_samples=8, reference_samples=8, boundary="round")


def test_round_accumulator_counts_a_round_larger_than_the_reference_as_one_reference_batch():
    """With reference_samples B a round of r <= B samples adds its sum over B (the linear scaling rule: 12 samples
    as 5 + 7 step at 1.5 times their mean); a round of more, all its micro-batches computed at the same weights,
    adds its mean and counts B samples (48 samples of B = 8: its mean, not 6 times it; counted in capped())."""
    accumulator = RoundAccumulator(step_samples=8, reference_samples=8)
    result = [torch.tensor([3.0, -1.5])]  # a round's sum over 8
    assert not accumulator.add(0, result, divisor=8.0, samples=5)
    assert accumulator.add(0, result, divisor=8.0, samples=7) and accumulator.samples(0) == 12
    assert torch.equal(accumulator.take(0)[0], 2 * result[0]) and accumulator.capped(0) == 0
    big = [torch.tensor([12.0, -6.0])]  # a round of 48 samples, its sum over 8: six times its mean [2, -1]
    assert accumulator.add(0, big, divisor=8.0, samples=48) and accumulator.samples(0) == 8
    assert torch.equal(accumulator.take(0)[0], torch.tensor([2.0, -1.0])) and accumulator.capped(0) == 1
    # A step of a short round and a large one: 4 samples at 4 / 8 of their mean ([3, -1.5] over 8 here) and 8 (the
    # large round's mean): 12 counted samples.
    assert not accumulator.add(0, result, divisor=8.0, samples=4)
    assert accumulator.add(0, big, divisor=8.0, samples=48) and accumulator.samples(0) == 12
    assert torch.equal(accumulator.take(0)[0], result[0] + torch.tensor([2.0, -1.0])) and accumulator.capped(0) == 2
    per_round = RoundAccumulator(step_samples=None, reference_samples=8)  # a step per round: alike
    assert per_round.add(0, big, divisor=8.0, samples=48)
    assert torch.equal(per_round.take(0)[0], torch.tensor([2.0, -1.0]))
    synchronous = RoundAccumulator(step_samples=8, reference_samples=8)  # limit=False: all its samples count
    assert synchronous.add(0, big, divisor=8.0, samples=48, limit=False) and synchronous.samples(0) == 48
    assert torch.equal(synchronous.take(0)[0], big[0]) and synchronous.capped(0) == 0
    mean_rule = RoundAccumulator(step_samples=8, reference_samples=None)  # the paper's mean: sample-weighted, as is
    assert mean_rule.add(0, [torch.tensor([2.0, -1.0])], divisor=48.0, samples=48) and mean_rule.capped(0) == 0
    assert torch.equal(mean_rule.take(0)[0], torch.tensor([2.0, -1.0]))


def test_round_accumulator_without_a_reference_takes_the_sample_weighted_mean():
    """reference_samples=None: each result is its round's mean over its samples (the divisor); the step is
    the mean over the step's samples: (2 * m1 + 6 * m2) / 8."""
    accumulator = RoundAccumulator(step_samples=8, reference_samples=None)
    m1, m2 = [torch.tensor([1.0, -3.0])], [torch.tensor([0.5, 0.25])]
    assert not accumulator.add(0, m1, divisor=2.0, samples=2)
    assert accumulator.add(0, m2, divisor=6.0, samples=6)
    assert torch.equal(accumulator.take(0)[0], (2 * m1[0] + 6 * m2[0]) / 8)
    per_round = RoundAccumulator(step_samples=None, reference_samples=None)  # the paper's rule
    assert per_round.add(0, m1, divisor=2.0, samples=2)
    assert torch.equal(per_round.take(0)[0], m1[0])


def test_round_accumulator_keeps_the_presence_numbers_across_a_checkpoint():
    """find_unused_parameters: each result ends with a presence number per parameter tensor; a resume keeps them,
    and one without the option is refused naming it (and the other way round)."""
    params = {0: [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]}
    first = RoundAccumulator(step_samples=8, reference_samples=8, presence=True)
    first.add(0, [torch.tensor([1.0, 2.0]), torch.zeros(3), torch.tensor([1.0, 0.0])], divisor=8.0, samples=5)
    checkpoint: dict = {}
    first.save(checkpoint)
    resumed = RoundAccumulator(step_samples=8, reference_samples=8, presence=True)
    resumed.load(checkpoint)
    resumed.reset(params)
    assert resumed.add(0, [torch.zeros(2), torch.ones(3), torch.tensor([0.0, 1.0])], divisor=8.0, samples=3)
    *gradient, presence = resumed.take(0)
    assert presence.tolist() == [1.0, 1.0] and gradient[1].tolist() == [1.0, 1.0, 1.0]
    without = RoundAccumulator(step_samples=8, reference_samples=8)
    without.load(checkpoint)
    with pytest.raises(ValueError, match=r"saved with find_unused_parameters=True: resume with that"):
        without.reset(params)
    plain: dict = {}
    other = RoundAccumulator(step_samples=8, reference_samples=8)
    other.add(0, [torch.ones(2), torch.ones(3)], divisor=8.0, samples=5)
    other.save(plain)
    with_it = RoundAccumulator(step_samples=8, reference_samples=8, presence=True)
    with_it.load(plain)
    with pytest.raises(ValueError, match=r"saved with find_unused_parameters=False: resume with that"):
        with_it.reset(params)


def test_round_accumulator_survives_a_checkpoint_but_refuses_another_model():
    params = {0: [torch.nn.Parameter(torch.zeros(2))]}
    first = RoundAccumulator(step_samples=8, reference_samples=8)
    first.add(0, [torch.tensor([1.0, 2.0])], divisor=8.0, samples=8)
    first.take(0)
    first.add(0, [torch.tensor([0.5, 0.5])], divisor=8.0, samples=5)  # accumulated when the checkpoint is taken
    checkpoint: dict = {}
    first.save(checkpoint)
    assert checkpoint[ACCUMULATED_KEY][0]["samples"] == 5
    resumed = RoundAccumulator(step_samples=8, reference_samples=8)
    resumed.load(checkpoint)
    resumed.reset(params)
    assert resumed.steps(0) == 1 and resumed.pending(0) == 1
    assert resumed.add(0, [torch.tensor([0.25, -1.0])], divisor=8.0, samples=3)
    assert torch.equal(resumed.take(0)[0], torch.tensor([0.75, -0.5]))  # nothing of the first rounds lost
    other = RoundAccumulator(step_samples=8, reference_samples=8)
    other.load(checkpoint)
    with pytest.raises(ValueError, match="accumulated rounds for optimizer 0 do not match"):
        other.reset({0: [torch.nn.Parameter(torch.zeros(3))]})
    elsewhere = RoundAccumulator(step_samples=8, reference_samples=8)
    elsewhere.load(checkpoint)
    elsewhere.forget_loaded()  # loaded to validate, not to fit
    elsewhere.reset(params)
    assert elsewhere.pending(0) == 0 and elsewhere.steps(0) == 0


# ------------------------------------------------------------------ global-batch scaling of local Adam steps
def _adam_step(optimizer, param, grad, scaling):
    """One step of ``optimizer`` on ``grad`` between the scaling's begin and finish; returns (w_before, w_after)."""
    param.grad = grad.clone()
    scaling.begin(0, optimizer, [param])
    before = param.detach().clone()
    optimizer.step()
    after = param.detach().clone()
    scaling.finish(0, optimizer, [param])
    return before, after


def test_global_batch_scaling_rescales_the_adaptive_part_by_the_documented_factor():
    """AdamW (decoupled decay), P = 4, float64, three steps of varied gradients: after each step the weights
    are w_after + (c - 1) * (w_after - (1 - lr wd) w_before), c = sqrt(v / (s + (v - s) / P)), s = min(m^2, v),
    m and v Adam's bias-corrected moments after the step; c lies in [1, 2]."""
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64))
    lr, wd, betas = 0.1, 0.01, (0.9, 0.99)
    optimizer = torch.optim.AdamW([param], lr=lr, weight_decay=wd, betas=betas)
    scaling = GlobalBatchScaling(world_size=4)
    grads = [torch.tensor([1.0, 1.0, 0.0, -2.0]), torch.tensor([1.0, -1.0, 0.0, 2.0]),
             torch.tensor([1.0, 1.0, 0.0, 0.5])]
    for t, g in enumerate(grads, start=1):
        before, after = _adam_step(optimizer, param, g.double(), scaling)
        state = optimizer.state[param]
        m = state["exp_avg"] / (1 - betas[0] ** t)
        v = state["exp_avg_sq"] / (1 - betas[1] ** t)
        s = torch.minimum(m * m, v)
        c = torch.where(v > 0, (v / (s + (v - s) / 4)).sqrt(), torch.ones_like(v))
        expected = after + (c - 1) * (after - (1 - lr * wd) * before)
        torch.testing.assert_close(param.detach(), expected, rtol=1e-14, atol=1e-15)
        assert bool(((c >= 1) & (c <= 2)).all())
        # Coordinate 0 always has gradient 1 (all signal: m^2 = v), coordinate 2 none (v = 0): not scaled;
        # coordinate 1 alternates in sign (noise): scaled up.
        assert float(c[0]) == pytest.approx(1.0, abs=1e-12) and float(c[2]) == 1.0
        assert t == 1 or float(c[1]) > 1.2


def test_global_batch_scaling_exact_cases():
    """Exactly: pure noise (m = 0) doubles the adaptive part at P = 4 (c = sqrt(P)); pure signal (m^2 >= v)
    leaves the step as Adam took it; a coordinate that never had a gradient (v = 0) and a parameter the
    step skipped are left alone; Adam's coupled decay is part of the adaptive part (scaled with it)."""
    scaling = GlobalBatchScaling(world_size=4)
    ones = torch.ones(3)
    assert torch.equal(scaling.factor(torch.zeros(3), ones, t=1e9, betas=(0.9, 0.999)), torch.full((3,), 2.0))
    assert torch.equal(scaling.factor(torch.full((3,), 2.0), ones, t=1e9, betas=(0.9, 0.999)), ones)
    assert torch.equal(scaling.factor(torch.zeros(3), torch.zeros(3), t=3, betas=(0.9, 0.999)), ones)
    # Half-precision state: computed in float32 (in float16, m^2 and the floor would under- and overflow).
    for dtype in (torch.float16, torch.bfloat16):
        noise = scaling.factor(torch.zeros(3, dtype=dtype), torch.full((3,), 1e-6, dtype=dtype), t=1e9,
                               betas=(0.9, 0.999))
        assert torch.equal(noise, torch.full((3,), 2.0))

    # The whole update, with the moments set to pure noise: the step's move doubles, exactly.
    param = torch.nn.Parameter(torch.tensor([4.0, 8.0]))
    # Adam's decay is coupled (part of the gradient, hence of m and v): none of the move is excluded.
    optimizer = torch.optim.Adam([param], lr=0.5, betas=(0.5, 0.5), weight_decay=0.5)
    param.grad = torch.tensor([1.0, 1.0])
    optimizer.step()  # creates the state (step 1)
    state = optimizer.state[param]
    scaling.begin(0, optimizer, [param])
    w_before = param.detach().clone()
    # "The optimizer step": the weights move by -1 and +3, the moments say pure noise, the step count advances.
    param.data.add_(torch.tensor([-1.0, 3.0]))
    state["exp_avg"].zero_()
    state["exp_avg_sq"].fill_(1.0)
    state["step"] += 1
    scaling.finish(0, optimizer, [param])
    assert torch.equal(param.detach(), w_before + 2 * torch.tensor([-1.0, 3.0]))

    # The step skipped this parameter (its count did not advance): untouched.
    scaling.begin(0, optimizer, [param])
    param.data.add_(1.0)
    scaling.finish(0, optimizer, [param])
    assert torch.equal(param.detach(), w_before + 2 * torch.tensor([-1.0, 3.0]) + 1.0)

    # A parameter without optimizer state (never had a gradient): untouched.
    other = torch.nn.Parameter(torch.zeros(2))
    optimizer.add_param_group({"params": [other]})
    scaling.begin(1, optimizer, [other])
    other.data.add_(5.0)
    scaling.finish(1, optimizer, [other])
    assert torch.equal(other.detach(), torch.full((2,), 5.0))


def test_global_batch_scaling_leaves_radams_unrectified_steps_alone():
    """RAdam's first steps (rho_t <= 5: the first 5 at beta2 = 0.999) move by the first moment alone, so the
    averaged local steps already are DDP's: not scaled; from its first rectified step on, scaled as Adam's."""
    from lightning_partial.strategies.adaptive_scaling import radam_rectified

    assert [radam_rectified(t, 0.999) for t in range(1, 8)] == [False] * 5 + [True] * 2
    scaling = GlobalBatchScaling(world_size=4)
    param = torch.nn.Parameter(torch.tensor([4.0, 8.0]))
    optimizer = torch.optim.RAdam([param], lr=0.5)
    for t in range(1, 8):
        param.grad = torch.tensor([1.0, -1.0]) if t % 2 else torch.tensor([-1.0, 1.0])  # noise: m about 0
        scaling.begin(0, optimizer, [param])
        before = param.detach().clone()
        optimizer.step()
        moved = param.detach() - before
        scaling.finish(0, optimizer, [param])
        scaled = not torch.equal(param.detach() - before, moved)
        assert scaled == (t >= 6), t


def test_global_batch_scaling_applies_to_the_adam_family_on_more_than_one_rank():
    param = [torch.nn.Parameter(torch.zeros(1))]
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam):
        assert resolve("auto", cls(param), world_size=4, owner="x") is True
        assert resolve("global_batch", cls(param), world_size=4, owner="x") is True
        assert resolve("none", cls(param), world_size=4, owner="x") is False
        assert resolve("auto", cls(param), world_size=1, owner="x") is False  # nothing to scale on one rank
    sgd = torch.optim.SGD(param, lr=0.1, momentum=0.9)
    assert resolve("auto", sgd, world_size=4, owner="x") is False  # averaged SGD steps already are DDP's
    with pytest.raises(ValueError, match=r"x: adaptive_scaling='global_batch' reads Adam's moments"):
        resolve("global_batch", sgd, world_size=4, owner="x")


def test_the_synchronous_finish_covers_the_last_fraction_of_the_steps(caplog):
    """``final_sync=f`` of ``T`` steps: rounds ``T - ceil(f T)`` .. ``T - 1`` are synchronous (at least one); off at
    0; a fit of unknown length (Lightning's ``inf``) runs without it and says so on rank 0 only."""
    from lightning_partial.strategies.final_sync import first_sync_round

    assert first_sync_round(0.1, 256, owner="eager_sgd") == 230  # 26 rounds: 230..255
    assert first_sync_round(0.05, 256, owner="eager_sgd") == 243
    assert first_sync_round(0.001, 30, owner="eager_sgd") == 29  # never none at all
    assert first_sync_round(0.0, 256, owner="eager_sgd") is None
    with caplog.at_level("WARNING"):
        assert first_sync_round(0.1, float("inf"), owner="wagma_sgd", rank=1) is None
        assert not caplog.records
        assert first_sync_round(0.1, float("inf"), owner="wagma_sgd", rank=0) is None
    assert "wagma_sgd: final_sync=0.1 needs the fit's length" in caplog.text


@pytest.mark.parametrize("steps", [False, True])
def test_a_checkpoint_trigger_taken_over_keeps_its_state_key_and_saves_nothing_by_itself(tmp_path, steps):
    """The batch-end hook runs with the trigger off (no broadcast, no save), while the attribute, and with it
    the key of the callback's state in a checkpoint, stays the user's; restoring gives the hook back."""
    from datetime import timedelta
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_partial import _compat

    kw = {"every_n_train_steps": 3} if steps else {"train_time_interval": timedelta(seconds=0)}
    callback = ModelCheckpoint(dirpath=tmp_path, **kw)
    key = callback.state_key
    if steps:
        assert _compat.take_over_step_checkpoints(callback) == 3
    else:
        assert _compat.take_over_time_checkpoint(callback) == 0.0
    assert callback.state_key == key

    def refuse(*args, **kwargs):
        raise AssertionError("the hook issued a collective or saved")

    trainer = SimpleNamespace(fast_dev_run=False, state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False,
                              global_step=3, strategy=SimpleNamespace(broadcast=refuse), save_checkpoint=refuse)
    callback._last_time_checked = 0.0  # a time-based save would be long due
    callback.on_train_batch_end(trainer, SimpleNamespace(automatic_optimization=True), None, None, 0)
    assert callback.state_key == key
    _compat.restore_checkpoint_triggers(callback)
    assert "on_train_batch_end" not in callback.__dict__ and callback.state_key == key


def test_epoch_end_checkpoint_hooks_run_with_rank_zeros_step_decision_and_candidates(tmp_path):
    """abs_sgd's ranks end an epoch at different global steps: a ModelCheckpoint's epoch-end hooks take rank 0's
    answer to "saved at this step" and rank 0's monitor candidates from one broadcast (here a stand-in
    strategy answering as rank 0; the 4-process fit in test_agreed_clock runs it across real ranks), whatever
    this rank's own; the candidates are gone after the hook, and restoring leaves the callback as it came."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_partial import _compat

    seen = []

    class Recording(ModelCheckpoint):
        def on_validation_end(self, trainer, pl_module):
            seen.append((self._last_global_step_saved == trainer.global_step, self._monitor_candidates(trainer)))

        def on_train_epoch_end(self, trainer, pl_module):
            seen.append((self._last_global_step_saved == trainer.global_step, self._monitor_candidates(trainer)))

    callback = Recording(dirpath=tmp_path, every_n_train_steps=1, save_last="link")
    key = callback.state_key
    rank_zero = {"epoch": torch.tensor(1), "step": torch.tensor(36)}
    sent, answer = [], {}

    def broadcast(obj, src=0):
        sent.append(obj)
        return (answer["saved"], rank_zero)

    trainer = SimpleNamespace(global_step=37, current_epoch=1, callback_metrics={},
                              strategy=SimpleNamespace(broadcast=broadcast))
    _compat.agree_epoch_end_checkpoints(callback)
    _compat.agree_epoch_end_checkpoints(callback)  # once per hook, however often asked
    for answer["saved"], own in ((True, 30), (False, 37)):
        callback._last_global_step_saved = own  # this rank's own answer is the other one
        callback.on_validation_end(trainer, None)
        callback.on_train_epoch_end(trainer, None)
    assert [s[0] for s in seen] == [True, True, False, False]
    assert all(s[1] == rank_zero for s in seen)
    assert sent[0][0] is False and int(sent[0][1]["step"]) == 37  # what this rank offered: its own
    assert "_monitor_candidates" not in callback.__dict__
    _compat.restore_checkpoint_triggers(callback)
    _compat.restore_checkpoint_triggers(callback)
    assert not {"on_validation_end", "on_train_epoch_end"} & set(callback.__dict__) and callback.state_key == key


def test_a_time_limit_taken_over_asks_once_per_fit_and_every_restore_gives_the_methods_back():
    """The Timer's batch-end hook requests the finish once (rank 0, once the time is up), issues no broadcast, and
    is taken over afresh by the next fit of the same trainer; each restore is idempotent, leaves no instance
    attribute behind and accepts a trainer without loops."""
    import time
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import Timer
    from lightning.pytorch.trainer.states import RunningStage

    from lightning_partial import _compat

    class EpochLoop:  # the two methods as Lightning's loop has them: on the class
        def _broadcast_sigterm_tensor(self) -> None: ...

        def _update_learning_rates(self, interval: str, update_plateau_schedulers: bool) -> None: ...

    timer = Timer(duration="00:00:00:01", interval="step")
    loop = EpochLoop()
    refuse = SimpleNamespace(broadcast=lambda *a, **k: pytest.fail("the Timer broadcast"))
    trainer = SimpleNamespace(callbacks=[timer], global_rank=0, strategy=refuse,
                              fit_loop=SimpleNamespace(_can_stop_early=True, epoch_loop=loop))
    for fit in range(2):
        requests: list[int] = []
        _compat.take_over_step_timers(trainer, lambda requests=requests, fit=fit: requests.append(fit))
        timer._start_time[RunningStage.TRAINING] = time.monotonic()  # just started: not yet
        timer.on_train_batch_end(trainer, None, None, None, 0)
        timer._start_time[RunningStage.TRAINING] = time.monotonic() - 5  # past the 1 s limit
        for batch in range(3):
            timer.on_train_batch_end(trainer, None, None, None, batch)
        assert requests == [fit]  # once per fit, though asked at every batch end
        _compat.restore_step_timers(trainer)
        _compat.restore_step_timers(trainer)
        assert "on_train_batch_end" not in timer.__dict__
    assert _compat.replace_sigterm_broadcast(trainer, lambda: False)
    assert _compat.step_schedulers_by_rounds(trainer)
    assert set(vars(loop)) == {"_broadcast_sigterm_tensor", "_update_learning_rates"}
    for _ in range(2):
        _compat.restore_sigterm_broadcast(trainer)
        _compat.restore_scheduler_stepping(trainer)
    assert vars(loop) == {}
    bare = SimpleNamespace(callbacks=[])  # no fit loop: nothing to give back
    _compat.restore_sigterm_broadcast(bare), _compat.restore_scheduler_stepping(bare)
    _compat.restore_time_validation(bare), _compat.restore_step_timers(bare)


@pytest.mark.parametrize("final, completed, ends, sync_from, epoch, expected", [
    (None, 0, {}, None, 0, (None, None)),  # mid-epoch
    (None, 1, {0: 10}, None, 0, ("epoch", 10)),
    (12, 1, {0: 10}, None, 0, ("epoch", 10)),  # the fit's end just after the epoch's: the epoch ends first
    (12, 1, {0: 10}, None, 1, ("fit", 12)),  # ... then the fit, in the next epoch
    (10, 1, {0: 10}, None, 0, ("fit", 10)),  # max_epochs: the same round
    (12, 0, {}, None, 0, ("fit", 12)),  # max_steps or a time limit mid-epoch
    (None, 1, {}, None, 0, ("epoch", None)),  # resumed after the epoch's last round: no boundary known
    (None, 1, {0: 10}, 5, 0, ("epoch", None)),  # a synchronous round: every rank applied it already
    (None, 3, {0: 10, 1: 10, 2: 11}, None, 1, ("epoch", 10)),  # one round completed two epochs
])
def test_abs_sgd_decides_the_last_batch_and_its_save_boundary_from_the_rounds(final, completed, ends, sync_from,
                                                                               epoch, expected):
    from lightning_partial.collectives.delayed import RoundProgress
    from lightning_partial.strategies.abs_sgd import ABSSGDStrategy

    progress = RoundProgress(final_round=final, epochs_completed=completed, epoch_end_rounds=ends,
                             sync_from=sync_from)
    assert ABSSGDStrategy._last_batch(progress, epoch) == expected


@pytest.mark.parametrize("ends, sync_from, boundary, expected", [
    ("fit", None, 12, True),  # nothing is synchronous after the fit's last round: arriving changes nothing
    ("epoch", 8, None, True),  # the epoch's last round is synchronous: lock-step, every last batch arrives
    ("epoch", None, 10, False),  # no finish known: asynchronous rounds, or one only a later round reveals
    ("epoch", 11, 10, True),  # the finish begins right after it: every rank's last micro-batch lands in round 11
    ("epoch", 12, 10, False),  # later: one rank's may land in round 12, another's in 11; none arrives
])
def test_abs_sgd_arrives_with_an_epochs_last_batch_only_where_every_rank_lands_in_the_same_round(
        ends, sync_from, boundary, expected):
    from lightning_partial.collectives.delayed import RoundProgress
    from lightning_partial.strategies.abs_sgd import ABSSGDStrategy

    progress = RoundProgress(final_round=None, epochs_completed=1, epoch_end_rounds={0: 10}, sync_from=sync_from)
    assert ABSSGDStrategy._epoch_end_arrival(ends, progress, boundary) is expected


def test_a_failed_collective_of_a_resumed_fit_names_its_checkpoints_last_round_before_its_first():
    """What a strategy's failed collective names as the last round (``_last_round``): this fit's latest round;
    before the first of a resumed fit, the last its checkpoint's engines had reached; before any, none."""
    from types import SimpleNamespace

    from lightning_partial import EagerSGDStrategy
    from lightning_partial.collectives import RoundStats

    strategy = EagerSGDStrategy()
    assert strategy._last_round() is None
    strategy._engines = {0: SimpleNamespace(step=0)}  # a fresh fit's engine: its next round is 0
    assert strategy._last_round() is None
    strategy._engines = {0: SimpleNamespace(step=18), 1: SimpleNamespace(step=12)}  # restored: next rounds 18, 12
    assert strategy._last_round() == 17
    strategy.round_stats[0] = RoundStats(
        round_index=18, activator=0, initiator=None, synchronous=False, flush=False, fresh=(0,), counts=(1, 1),
        staleness=(0, 0), oldest_staleness=(0, 0), progress=(19, 19), dropped=(0, 0), contributions=2, divisor=2,
    )
    assert strategy._last_round() == 18


def test_adaptive_batch_size_ignores_results_restored_from_a_checkpoint_of_another_world_size():
    """A resumed fit on 4 ranks first applies results restored from a 2-rank checkpoint (their counts are the old
    ranks'): AdaptiveBatchSize measures only this world's rounds, where it raised IndexError."""
    from types import SimpleNamespace

    from lightning_partial.callbacks.adaptive_batch_size import AdaptiveBatchSize
    from lightning_partial.collectives import RoundStats

    def stats(r: int, world: int) -> RoundStats:
        return RoundStats(round_index=r, activator=-1, initiator=None, synchronous=True, flush=False, fresh=(),
                          counts=(4,) * world, staleness=(None,) * world, oldest_staleness=(None,) * world,
                          progress=(), dropped=(), contributions=4 * world, divisor=4.0 * world, busy=(1.0,) * world)

    for window in (4, 2):  # a window that would mix the old results with new ones, and one of old ones only
        old = [stats(10 - window, 2), stats(11 - window, 2)] if window == 2 else [stats(8, 2), stats(9, 2)]
        callback = AdaptiveBatchSize(window=window)
        callback._strategy = SimpleNamespace(loader_batch_sizes=(8, 8, 8, 8), sampler=SimpleNamespace(batch_size=8),
                                             sync_round_samples=32, micro_batches_per_round=1)
        callback._rank = 3
        for s in [*old, *(stats(r, 4) for r in range(10, 18))]:
            callback._on_round(0, s)
        assert callback.sizes is not None and len(callback.sizes) == 4


@pytest.mark.parametrize(
    "steps_done, first_round, saved_world, world, max_steps, estimated, want",
    [
        (0, 0, 4, 4, -1, 100, 95),  # a new fit: the last 5 of 100 rounds
        (50, 50, 4, 4, -1, 100, 95),  # resumed with engine state before the finish: where it was
        (97, 97, 4, 4, -1, 100, 95),  # resumed inside it: the same index, below the first round
        (40, 40, 4, 4, -1, 100, 95),  # resumed without engine state (begin_at the step): where it was
        (32, 32, 4, 2, -1, 128, 89),  # 4 ranks -> 2, epochs: 32 steps there are 64 here; the last 7 of 64 left
        (64, 64, 2, 4, -1, 64, 92),  # 2 ranks -> 4, epochs: 64 steps there are 32 here; the last 4 of 32 left
        (40, 40, 4, 2, 100, 100, 95),  # another world size, max_steps binding: the steps count as they are
    ],
)
def test_the_synchronous_finish_is_the_last_rounds_the_fit_runs(steps_done, first_round, saved_world, world,
                                                                  max_steps, estimated, want):
    """``ConfiguredStrategy._finish_from``: the first round of the finish, from Lightning's estimate of the fit's
    steps, the engine's first round and the steps done (at the checkpoint's world size where the fit resumed on
    another one)."""
    from types import SimpleNamespace

    from lightning_partial import EagerSGDStrategy

    class Placed(EagerSGDStrategy):
        @property
        def _trainer(self):
            return SimpleNamespace(estimated_stepping_batches=estimated, max_steps=max_steps, global_step=steps_done)

        @property
        def world_size(self) -> int:
            return world

    strategy = Placed(final_sync=0.05)
    strategy._first_round, strategy._saved_world_size = first_round, saved_world
    assert strategy._finish_from(0) == want


@pytest.mark.parametrize(
    "estimated, steps_done, first_round, since, want",
    [
        (100, 0, 0, 0, 23),  # a new fit of 100 steps: rounds at steps 3, 7, ..., 91 (0-22) before it, 23 at step 95
        (100, 50, 12, 2, 23),  # resumed at step 50 (round 11 at step 47; 48 and 49 local): the same round
        (100, 93, 23, 1, 23),  # resumed between the last round before it and its first step
        (100, 97, 24, 1, 22),  # inside the finish (round 23 at step 95): below the first round, nothing begun again
        (97, 50, 12, 2, 23),  # 97 steps, the finish from step 92: round 23 at step 95, the first at or after it
        (97, 50, 12, 0, 22),  # ... had it counted its period from the resume: round 22 at step 93 (hence the count)
    ],
)
def test_with_local_steps_the_finish_is_the_first_round_at_or_after_its_first_step(estimated, steps_done,
                                                                                   first_round, since, want):
    """``average_every=4``, ``final_sync=0.05`` of 100 steps (steps 95-99) or of 97 (92-96): the finish's first
    round is the first at or after its first step; a resumed fit places it by where it stands in its period."""
    from types import SimpleNamespace

    from lightning_partial import DSSyncStrategy

    class Placed(DSSyncStrategy):
        @property
        def _trainer(self):
            return SimpleNamespace(estimated_stepping_batches=estimated, max_steps=-1, global_step=steps_done)

        @property
        def world_size(self) -> int:
            return 4

    strategy = Placed(final_sync=0.05, average_every=4)
    strategy._first_round, strategy._saved_world_size = first_round, 4
    strategy._local_steps._since = {0: since}
    assert strategy._finish_from(0) == want


def test_local_steps_count_each_optimizers_period_and_survive_a_checkpoint():
    """``average_every=3``: steps 2, 5, ... join the round; ``rounds_in`` counts the rounds of the next steps from
    where the period stands (negative, inside the finish: as many below);
    a checkpoint keeps the counts where a period is under way, and :meth:`begin` (not ``reset``) takes them up."""
    from lightning_partial.strategies.local_steps import LOCAL_STEPS_KEY, LocalSteps

    local = LocalSteps(3)
    local.begin()
    joined = []
    for _ in range(7):
        joined.append(local.joins_round(0))
        local.stepped(0, averaged=joined[-1])
    assert joined == [False, False, True, False, False, True, False]
    assert local.since(0) == 1 and local.since(1) == 0
    assert [local.rounds_in(0, n) for n in (0, 1, 2, 4, 5, -2)] == [0, 0, 1, 1, 2, -2]
    checkpoint: dict = {}
    local.save(checkpoint)
    assert checkpoint == {LOCAL_STEPS_KEY: {0: 1}}
    resumed = LocalSteps(3)
    resumed.load(checkpoint)
    resumed.reset({})  # after the engines are built: nothing to take up there
    assert resumed.since(0) == 0
    resumed.begin()
    assert resumed.since(0) == 1
    again = LocalSteps(3)
    again.load(checkpoint)
    again.forget_loaded()  # loaded to validate: not for a later fit
    again.begin()
    assert again.since(0) == 0
    empty: dict = {}
    LocalSteps(3).save(empty)
    assert empty == {}
