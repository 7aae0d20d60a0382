"""finish="gradients": DDP's step in the synchronous finish of model averaging.

The collectives on exact arithmetic across real gloo ranks (threads), the
option's bad input, and 4-process fits: a fit that is all finish is DDP's.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_partial import DSSyncStrategy, WAGMAStrategy
from lightning_partial.collectives import PartialCollectiveError
from lightning_partial.strategies import gradient_finish
from lightning_partial.strategies.gradient_finish import GradientFinish
from tests.distributed import run_threads
from tests.test_eager_sgd import assert_identical, fit
from tests.test_model_averaging import run_fit

P = 4


@pytest.mark.parametrize("build", [lambda: WAGMAStrategy(finish="ddp"), lambda: DSSyncStrategy(finish=None)])
def test_unknown_finish_fails_at_construction(build):
    with pytest.raises(ValueError, match="unknown finish"):
        build()


def test_finish_resolves_per_optimizer():
    """"models" (the default) changes nothing; "gradients" applies to SGD and the Adam family on more than
    one rank, and is refused, naming the option, for an optimizer whose state the finish cannot average."""
    assert WAGMAStrategy().finish == "models" and DSSyncStrategy().finish == "models"
    w = [torch.nn.Parameter(torch.zeros(2))]
    adamw, sgd, adagrad = torch.optim.AdamW(w), torch.optim.SGD(w, lr=0.1, momentum=0.9), torch.optim.Adagrad(w)
    resolve = gradient_finish.resolve
    assert resolve("gradients", adamw, world_size=4, owner="t") and resolve("gradients", sgd, world_size=4, owner="t")
    assert not resolve("gradients", adamw, world_size=1, owner="t")  # one rank: nothing to average
    assert not resolve("models", adamw, world_size=4, owner="t") and not resolve("models", adagrad, world_size=4,
                                                                                   owner="t")
    with pytest.raises(ValueError, match="finish='gradients'.*Adagrad"):
        resolve("gradients", adagrad, world_size=4, owner="wagma_sgd")


def test_a_set_up_strategy_still_pickles():
    """The finish's collectives hold the collective group (set-up makes them); pickling drops them, as it
    drops the group itself (the spawn launcher pickles the strategy)."""
    import pickle
    import threading

    strategy = WAGMAStrategy(finish="gradients")
    strategy._gradient_finish = GradientFinish(group=threading.Lock(), rank=0, world_size=2,  # a lock: unpicklable
                                               arrival_timeout=timedelta(seconds=1), timeout=timedelta(seconds=1))
    assert pickle.loads(pickle.dumps(strategy))._gradient_finish is None


def _group(rank: int, store: dist.Store, name: str = "finish") -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, P, timedelta(seconds=30))


def _finish(rank: int, store: dist.Store, seconds: float = 30) -> GradientFinish:
    bound = timedelta(seconds=seconds)
    return GradientFinish(group=_group(rank, store), rank=rank, world_size=P, arrival_timeout=bound, timeout=bound)


def test_mean_gradients_is_the_sum_over_ranks_divided_by_p():
    """Dyadic values (exact in float32): each gradient becomes sum/P on every rank; a rank without a
    gradient counts as zero and receives the mean; a parameter no rank has a gradient for keeps None;
    float64 and bfloat16 parameters travel in their own buffers (bfloat16 summed as float32)."""
    def grads(rank: int) -> list:
        return [torch.arange(6.0).reshape(2, 3) * (rank + 1) / 8, torch.full((3,), 2.0**rank) if rank in (1, 2)
                else None, None, torch.tensor([0.5 * rank], dtype=torch.float64),
                torch.tensor([0.25, 3.0], dtype=torch.bfloat16) * (rank + 1)]

    def fn(rank: int, store: dist.Store):
        params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3)),
                  torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)),
                  torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
        for p, g in zip(params, grads(rank)):
            p.grad = g
        _finish(rank, store).mean_gradients(params, round_index=7)
        return [None if p.grad is None else p.grad.clone() for p in params]

    results = run_threads(P, fn)
    per_rank = [grads(r) for r in range(P)]
    expected = [sum(g[0] for g in per_rank) / P, (2.0**1 + 2.0**2) * torch.ones(3) / P, None,
                sum(g[3] for g in per_rank) / P, torch.tensor([0.625, 7.5], dtype=torch.bfloat16)]
    for got in results:
        assert got[2] is None
        for i in (0, 1, 3, 4):
            assert got[i].dtype == expected[i].dtype and torch.equal(got[i], expected[i]), i


def test_mean_in_place_averages_floats_and_takes_rank0s_for_the_rest():
    """The shared helper (the end-of-fit buffer average and this finish's state average): floating tensors
    become their mean (bfloat16 summed as float32), integer and bool tensors and flagged ones rank 0's, on
    every rank alike; one sum per dtype."""
    from lightning_partial.strategies.rank_mean import mean_in_place

    def tensors(rank: int) -> list:
        return [torch.arange(4.0) * (rank + 1) / 8, torch.tensor([rank + 10]),
                torch.tensor([0.5, 2.0], dtype=torch.bfloat16) * (rank + 1), torch.tensor([rank != 0]),
                torch.tensor(3.0 + rank)]

    def fn(rank: int, store: dist.Store):
        group, sums = _group(rank, store, "mean"), []

        def sum_(buffer: torch.Tensor) -> None:
            sums.append(buffer.dtype)
            dist.all_reduce(buffer, group=group)

        mine = tensors(rank)
        mean_in_place(mine, rank=rank, world_size=P, sum_=sum_, from_rank0=[False, False, False, False, True])
        return mine, sums

    results = run_threads(P, fn)
    expected = [torch.arange(4.0) * 10 / 32, torch.tensor([10]), torch.tensor([1.25, 5.0], dtype=torch.bfloat16),
                torch.tensor([False]), torch.tensor(3.0)]  # bool: rank 0's False, not any() of the others' True
    for got, sums in results:
        assert sums == [torch.float32, torch.int64, torch.float32, torch.uint8]  # one per dtype: bf16 as float32
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and torch.equal(g, e), (g, e)


def test_an_end_of_fit_mean_without_a_peer_fails_naming_rank_what_and_round():
    """The strategies' end-of-fit mean (buffers, model averaging's final parameters): a rank that never joins
    turns into an error on the others within the group's timeout, naming the rank, what was averaged and the
    last round, never a hang."""
    from lightning_partial.strategies.rank_mean import allreduce_sum, mean_in_place

    def fn(rank: int, store: dist.Store):
        # The group's timeout also bounds its connection: 3 s, not 1, for a loaded machine.
        group = dist.ProcessGroupGloo(dist.PrefixStore("end", store), rank, P, timedelta(seconds=3))
        if rank == P - 1:
            import time

            time.sleep(6)  # alive, never joining
            return None
        with pytest.raises(PartialCollectiveError, match=r"rank \d, round 17\] the mean of the end-of-fit buffers over the ranks after the last round failed"):
            mean_in_place([torch.ones(3)], rank=rank, world_size=P,
                          sum_=allreduce_sum(group, rank=rank, what="the end-of-fit buffers", last_round=17))
        return "raised"

    assert run_threads(P, fn, timeout=60)[:-1] == ["raised"] * (P - 1)


def test_a_sparse_gradient_on_one_rank_fails_every_rank_together():
    """The sparse gradient is flagged in the round's buffer, so every rank raises (none waits for a sum
    that the others abandoned), naming the option's alternative."""
    def fn(rank: int, store: dist.Store):
        p = torch.nn.Parameter(torch.zeros(4))
        if rank == 0:
            p.grad = torch.sparse_coo_tensor([[1]], [1.0], (4,))
        with pytest.raises(PartialCollectiveError, match=rf"rank {rank}, round 2\].*sparse.*finish='models'"):
            _finish(rank, store).mean_gradients([p], round_index=2)
        return "raised"

    assert run_threads(P, fn, timeout=60) == ["raised"] * P


def _adam_state(rank: int, amsgrad: bool) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """Two parameters with AdamW state of dyadic values that differ per rank (step 3 on rank 0, 5 elsewhere:
    the step is taken from rank 0); a third whose state only ranks 0 and 1 have."""
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2)),
              torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.5, 0.75), amsgrad=amsgrad)
    for p in params[:2]:
        m = (torch.arange(4.0).reshape(p.shape) - 1.5) * (rank + 1) / 4
        v = (torch.arange(4.0).reshape(p.shape) + 1) * (rank + 2) / 16
        opt.state[p] = {"step": torch.tensor(3.0 if rank == 0 else 5.0), "exp_avg": m, "exp_avg_sq": v}
        if amsgrad:
            opt.state[p]["max_exp_avg_sq"] = v * 2
    if rank < 2:
        opt.state[params[2]] = {"step": torch.tensor(1.0), "exp_avg": torch.full((3,), float(rank)),
                                "exp_avg_sq": torch.full((3,), 1.0 + rank)}
    return params, opt


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("noise_correction", [False, True])
def test_average_state_is_the_mean_with_the_documented_noise_correction(noise_correction, amsgrad):
    """exp_avg: the mean over the ranks; exp_avg_sq (and max_exp_avg_sq): the mean, then, with the
    correction, s + (v - s) / P for s = min(m^2 (1 - b2^t) / (1 - b1^t)^2, v) at rank 0's step; identical on
    every rank. A parameter whose state some rank lacks has it dropped on every rank (the optimizer starts it
afresh, identically)."""
    def fn(rank: int, store: dist.Store):
        params, opt = _adam_state(rank, amsgrad)
        _finish(rank, store).average_state(opt, params, noise_correction=noise_correction, round_index=3)
        return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]

    results = run_threads(P, fn)
    states = [_adam_state(r, amsgrad) for r in range(P)]
    for i in range(2):
        per_rank = [opt.state[params[i]] for params, opt in states]
        m = sum(s["exp_avg"] for s in per_rank) / P
        t = 3.0
        expected = {"step": torch.tensor(t), "exp_avg": m}
        for key in ("exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg_sq",):
            v = sum(s[key] for s in per_rank) / P
            if noise_correction:
                s = torch.minimum(m * m * ((1 - 0.75**t) / (1 - 0.5**t) ** 2), v)
                v = s + (v - s) / P
            expected[key] = v
        if amsgrad:
            expected["max_exp_avg_sq"] = torch.maximum(expected["max_exp_avg_sq"], expected["exp_avg_sq"])
        for got in results:
            assert set(got[i]) == set(expected)
            for key, value in expected.items():
                assert torch.equal(got[i][key], value), (i, key)
    for got in results:  # the third parameter had state on ranks 0 and 1 only: dropped on every rank
        assert got[2] == {}


def test_a_rank_that_never_joins_fails_the_others_naming_rank_and_round():
    """A rank that does not reach the finish's collective (dead, stalled): the others fail within the
    bound with an error that names them and the round, never a hang."""
    def fn(rank: int, store: dist.Store):
        group = _group(rank, store)
        if rank == P - 1:
            import time

            time.sleep(3)  # alive, never joining: the others' bounded wait expires first
            return None
        params = [torch.nn.Parameter(torch.zeros(3))]
        params[0].grad = torch.ones(3)
        # The round's first collective waits for the slowest rank's compute: bounded by the strategy's timeout.
        with pytest.raises(PartialCollectiveError, match=rf"rank {rank}, round 41\].*exceeded timeout="):
            GradientFinish(group=group, rank=rank, world_size=P, arrival_timeout=timedelta(seconds=1),
                           timeout=timedelta(seconds=1)).mean_gradients(params, round_index=41)
        return "raised"

    assert run_threads(P, fn, timeout=60)[:-1] == ["raised"] * (P - 1)


@pytest.mark.timeout(300)
def test_a_fit_that_is_all_finish_takes_ddps_adamw_steps(tmp_path):
    """AdamW, 4 processes, ``final_sync=0.99``: every one of the 20 rounds is a finish round, so each step is
    DDP's (the gradients' mean, one optimizer state): the weights equal DDP's fit to rounding (DDP divides
    before it sums), the replicas are bit-identical, and the rule is logged. With ``finish="models"`` (the
    global average of local Adam steps) the weights are measurably not DDP's."""
    ddp = fit(tmp_path, "ddp", "--optimizer", "adamw", "--steps", "20")[0]
    finals = {}
    for finish in ("gradients", "models"):
        out = tmp_path / finish
        records = run_fit(out, "wagma_sgd", "--optimizer", "adamw", "--steps", "20", "--strategy-kw",
                          json.dumps({"final_sync": 0.99, "finish": finish}))
        assert [r["update_rule"]["finish"] for r in records] == [finish] * 4
        finals[finish] = assert_identical(out)
        states = {json.dumps(r["optimizer_state"]) for r in records}
        assert len(states) == (1 if finish == "gradients" else 4)  # one optimizer state, or each rank's own
    for key, value in ddp.items():
        torch.testing.assert_close(finals["gradients"][key], value, rtol=0, atol=1e-6)
    assert max((finals["models"][k] - v).abs().max().item() for k, v in ddp.items()) > 1e-3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, kw, extra", [
    ("ds_sync", {"final_sync": 0.5, "max_staleness": 2, "finish": "gradients"},
     ("--optimizer", "adamw", "--weight-decay", "0.01")),
    ("wagma_sgd", {"final_sync": 0.5, "finish": "gradients"}, ("--momentum", "0.9", "--weight-decay", "0.01")),
    ("wagma_sgd", {"final_sync": 0.5, "finish": "gradients", "order": "average_then_step"},
     ("--momentum", "0.9", "--weight-decay", "0.01", "--unused")),
])
def test_a_finish_after_wait_avoiding_rounds_ends_identical(tmp_path, strategy, kw, extra):
    """Half the fit wait-avoiding under a straggler, then the finish: its first round averages the parameters
    and the optimizer state, every finish round the gradients; the replicas end bit-identical and with one
    optimizer state, in both orders, under AdamW with decoupled decay and under SGD with momentum and coupled
    weight decay (which reads the weights: the first round must start from one model), and a layer that no
    rank uses stays untouched as under DDP (with one that only rank 0 uses, whose state is dropped)."""
    out = tmp_path / strategy
    records = run_fit(out, strategy, "--straggle-ms", "10", "--steps", "16", "--strategy-kw", json.dumps(kw),
                      *extra)
    assert [r["update_rule"]["finish"] for r in records] == ["gradients"] * 4
    assert_identical(out)
    assert len({json.dumps(r["optimizer_state"]) for r in records}) == 1  # one optimizer state on every rank
    if "--unused" in extra:
        assert not any(k.startswith("unused.") for k in records[0]["changed"]), records[0]["changed"]
