"""ABSSGDStrategy (``strategy="abs_sgd"``): delayed synchronous SGD with adaptive per-rank batches.

The rules (what starts a round, the one-round delay, epochs by global samples)
are :mod:`lightning_partial.collectives.delayed`'s. On the Lightning side:

* **A Lightning step is a micro-batch.** Each batch a rank draws is one
  micro-batch: forward and backward, then its gradient and sample count go to
  the engine (``deposit``), which hands back the round results now due
  (usually zero or one; a slow rank may get several). The results are added up
  until a step is due (below); each step is one ``optimizer.step()``, preceded by Lightning's
  ``on_before_optimizer_step`` hooks and gradient clipping; ``trainer.global_step``
  counts these steps, not the micro-batches, and each step's hooks see it count
  the steps before it (a batch may take several). What Lightning runs once per
  batch cannot follow the steps and is refused at set-up (a
  ``LightningModule.optimizer_step`` override, a step-interval
  ``ReduceLROnPlateau``, ``limit_train_batches``).
* **Weight prediction** (``weight_prediction=True``, main thread, no collective).
  A micro-batch's gradient is applied one round late: before its forward pass
  the last round's update is added to the weights, and after its backward pass
  the weights are restored from a copy (exactly, so replicas stay identical).
  The mechanism is :mod:`~lightning_partial.strategies.prediction`'s, shared
  with ``eager_sgd``; the last update is kept in checkpoints. How late each
  micro-batch is in optimizer steps (a fast rank's often 0, a slow rank's
  full micro-batch 2 or 3) is measured per rank in :attr:`ABSSGDStrategy.step_lags`
  (:mod:`~lightning_partial.strategies.step_lag`; ``StalenessTracker`` logs it).
* **One optimizer step per global batch** (``step_samples="global_batch"``):
  the results are added (:mod:`~lightning_partial.strategies.accumulation`)
  until the rounds since the last step hold about the samples of a
  synchronous step (``step_boundary``: the round nearest to them); the
  optimizer then steps once on their sum over the global batch
  (``reference_samples="global_batch"``). Rounds are small (every fast rank's
  micro-batch may start one); an optimizer stepping per round takes as many
  steps, each on a fraction of DDP's batch, which an Adam-like optimizer
  does not scale down (see docs/staleness.md, abs_sgd).
* **LR schedulers** with ``interval="step"`` step once per optimizer step,
  right after it (``frequency`` counts steps), not once per batch as
  Lightning would: every rank then uses the same learning rate for the same
  round (ranks run different numbers of batches). The final round's results
  at the end of fit step none (but the rounds another rank applied in a
  batch, where a ``should_stop`` ended the fit at an epoch end: those step
  them, as in that batch). ``interval="epoch"`` and
  plateau schedulers keep Lightning's handling.
* **Data.** The train loader's ``DistributedSampler`` (injected by Lightning,
  ``use_distributed_sampler=True``) is replaced by an
  :class:`~lightning_partial.data.ElasticBatchSampler` with the same per-rank
  batch size: batches never run out, a fast rank simply draws more.
* **Epochs and the end.** An epoch ends, on every rank, at the round whose
  global samples complete ``len(dataset)`` samples: each rank marks its next
  batch as the epoch's last, so validation and epoch-end hooks run as usual.
  ``max_epochs`` and ``max_steps`` make a round final (``max_steps`` counts
  rounds: the engine ends at a round, and the optimizer steps fewer times
  when ``step_samples`` adds several rounds per step); every rank
  then stops. At the end of fit, and before every checkpoint, the ranks agree
  on the last round in flight (one barrier and one integer allreduce on the
  strategy's collective group: never per step) and wait for it; at the end of fit a final
  synchronous round sums everything still pending, and every result not yet
  applied is applied: the replicas end bit-identical.
* **The delay** (``delay``). ``1``: the paper's rounds, each result applied
  one round late, as above. ``0``: every round synchronous from the first (the
  engine's ``sync_from=0``): every rank's every micro-batch joins the next round,
  which waits for the slowest, and its result is applied when that round
  completes, before the next micro-batch is computed: fresh gradients,
  no staleness rule, and ``trigger``, ``target_samples``, ``interval`` and
  ``final_sync`` have nothing left to do. The ranks still contribute different
  samples (with :class:`~lightning_partial.callbacks.AdaptiveBatchSize`, each
  rank's share of a step sized to its measured speed, so that the ranks finish together and a
  round is one step: by default (``arrival="samples"``) each rank arrives with the micro-batch that
  brings the round, counted over every rank in the store (``DelayedAllreduce.count_round_samples``),
  nearest to the step (:func:`closes_round`); with ``arrival="count"`` after the same number of
  micro-batches on every rank, in lock-step; with ``arrival="time"`` with the micro-batch that ends
  nearest to the round's time, ``round_seconds``, read from ``DelayedAllreduce.work_since_arrival``);
  what a round costs beyond the slowest share is its allreduce, no longer
  hidden behind the next micro-batches, and the wait for the last arrival.
  By samples or by time a rank that arrives does not wait
  (``overlap_arrival=True``, ``DelayedAllreduce.deposit(wait=False)``): it
  computes its next micro-batch while the round completes, at the predicted
  weights, and applies the round's result after it; that micro-batch joins
  the next round one step late. The deposit that hands the round does not
  arrive (every round before the one a rank arrives at is applied, and its
  saves made, first), and the round counts towards an epoch's or the fit's
  end once handed (``DelayedAllreduce.progress``): the same batch on every
  rank. ``"auto"`` (default): ``0`` when every
  optimizer is Adam-like (``betas``) or an ``AdaptiveBatchSize`` callback is in
  the fit, ``1`` otherwise. Under AdamW no update rule made a result one round
  late as good as a fresh one; under SGD momentum with ``AdaptiveBatchSize``
  the delay bought 1.2x the samples/s for 1.6 points, and the synchronous
  rounds reach DDP's final loss in two thirds of its time (docs/staleness.md).
  Without ``AdaptiveBatchSize`` (speeds that vary from batch to batch) the
  synchronous rounds would wait for every straggler, as DDP does.
* **The synchronous finish** (``final_sync=f``, default 0.05). The last ``f``
  of the fit's global samples (``max_epochs``) or rounds (``max_steps``;
  whichever starts first when both are set) run as synchronous rounds: every
  rank's every micro-batch joins the next round, which waits for the slowest,
  and its result is applied at once (the engine's ``sync_from_samples`` and
  ``sync_from``). From the second such round on the gradients are fresh: no
  staleness rule (a step holding an older round keeps it); weight prediction
  stays, as a look-ahead; the fit ends on DDP's rounds, summed by samples.
  The threshold is the same on every rank (global samples from the round
  headers) and survives a resume (it is counted from the fit's first round).
* **Checkpoints** hold the round counter, each rank's pending gradient sum and
  samples, the results not yet applied, and the global samples. Save at epoch
  ends, from a hook that every rank reaches, or with ``ModelCheckpoint(
  every_n_train_steps=n)``: a batch may apply two rounds, so a rank can step
  over a multiple of ``n`` that another stops at; the strategy therefore takes
  over that trigger and saves once per multiple passed, queued as the round
  that reaches it is applied and run at the rank's next batch start.
  ``train_time_interval`` is rank 0's clock, announced in a round and queued
  the same way (:mod:`~lightning_partial.strategies.agreed_clock`). At an
  epoch's last batch the saves of the rounds before the epoch's last round run
  at the batch's end, before the epoch-end hooks (``_saves_before_epoch_end``).
  At the switch to the synchronous finish a rank with rounds still to apply
  (whose saves the others may be running) applies them before it arrives
  (the engine holds that arrival; see ``DelayedAllreduce.deposit``).
  An epoch whose last round comes before the fit's (a time limit or
  ``max_steps`` just after an epoch end) ends first on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Sized
from typing import Any, Callable, Optional, Union, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import Unpack, override

import lightning.pytorch as pl
from lightning_partial import _compat
from lightning_partial.collectives import RoundResult, RoundStats
from lightning_partial.collectives.delayed import TRIGGERS, DelayedAllreduce, DelayedConfig, RoundProgress, Trigger
from lightning_partial.collectives.errors import naming_failure
from lightning_partial.collectives.staleness import StalenessWeights
from lightning_partial.collectives.checks import is_int_at_least
from lightning_partial.data import ElasticBatchSampler
from lightning_partial.strategies import compensation
from lightning_partial.strategies.accumulation import RoundAccumulator, check_boundary
from lightning_partial.strategies.checkpoint import state_for_rank
from lightning_partial.strategies.final_sync import first_sync_round
from lightning_partial.strategies.options import StrategyOptions
from lightning_partial.strategies.fit_state import FitState
from lightning_partial.strategies.partial import PartialStrategy, StepModel
from lightning_partial.strategies.prediction import LAST_UPDATE_KEY  # noqa: F401 - where it was first defined
from lightning_partial.strategies.step_lag import StepLag

log = logging.getLogger(__name__)

#: ``reference_samples``' default: the global batch of a synchronous step (resolved at the start of fit).
GLOBAL_BATCH = "global_batch"

#: The hooks besides the training step's closure that Lightning runs at every training batch of a fit, by the
#: names it gives them (``_compat.current_hook``): a collective issued in one pairs batches across ranks. The batch
#: transfer hooks run for validation batches too: they count while training only.
_BATCH_HOOKS = frozenset({
    "on_train_batch_start", "on_train_batch_end",
    "on_before_batch_transfer", "batch_to_device", "transfer_batch_to_device", "on_after_batch_transfer",
})
#: The hooks that run once per optimizer step, i.e. per round this rank applies (``_apply``): in round order on
#: every rank, between the saves queued by the rounds (run at batch starts, in round order too), so a collective
#: in one pairs where every round is synchronous (``delay=0``); under ``delay=1`` a rank applies a round on
#: either side of an epoch end's hooks, so it cannot.
_STEP_HOOKS = frozenset({"on_before_optimizer_step", "configure_gradient_clipping", "lr_scheduler_step"})
#: ``delay``'s values: the rounds a result waits, or ``"auto"`` (0 under Adam-like optimizers or with
#: AdaptiveBatchSize, else 1).
DELAYS: tuple[Union[int, str], ...] = (0, 1, "auto")


@dataclass
class _StepCheckpoint:
    """A ``ModelCheckpoint(every_n_train_steps=every)`` that the strategy triggers; ``queued``: multiples queued."""

    callback: ModelCheckpoint
    every: int
    queued: int = 0


class _EpochEndSaves(pl.Callback):
    """abs_sgd's own callback (added at set-up, removed at teardown): at the end of an epoch's last batch, the
    saves that must come before the epoch-end hooks (:meth:`ABSSGDStrategy._saves_before_epoch_end`)."""

    def __init__(self, strategy: "ABSSGDStrategy") -> None:
        self.strategy = strategy

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.strategy._saves_before_epoch_end()


def check_validation_schedule(trainer: Any) -> None:
    """Refuses validation every N batches (``Trainer(val_check_interval=...)`` other than 1.0).

    Under ABS-SGD each rank runs as many batches as its speed allows, so a batch
    count is reached a different number of times on each rank: the validation's
    ``sync_dist`` logging, checkpoints and the quiesce barrier would then wait for
    ranks that never come. Epoch ends are agreed rounds: validate there.
    """
    seconds = _compat.time_validation_interval(trainer)
    if seconds is not None:
        raise ValueError(
            f"abs_sgd: Trainer(val_check_interval=<{seconds:g} s>) validates by time, in the middle of an epoch, "
            "and each rank runs as many batches as its speed allows, so no batch is the same point on every "
            "rank. Validate at epoch ends: leave val_check_interval=1.0 (the default) and use "
            "check_val_every_n_epoch"
        )
    interval = getattr(trainer, "val_check_interval", 1.0)
    if isinstance(interval, bool) or interval == 1.0 and isinstance(interval, float):
        return
    raise ValueError(
        f"abs_sgd: Trainer(val_check_interval={interval!r}) validates after a number of batches, and each rank "
        "runs as many batches as its speed allows, so the ranks would validate at different times and wait for "
        "each other until the timeout. Validate at epoch ends: leave val_check_interval=1.0 (the default) and "
        "use check_val_every_n_epoch"
    )


def check_batch_limits(trainer: Any, *, world_size: int) -> None:
    """Refuses ``Trainer(limit_train_batches=...)`` other than 1.0 (or 0: no training) on more than one rank.

    Lightning counts the limit in this rank's own batches, and under ABS-SGD each rank runs as many
    batches as its speed allows, while the strategy ends epochs at the round that completes the
    dataset's samples: the ranks' epochs (and their epoch-end hooks: validation, checkpoints, all
    collective) would end at different rounds. ``fast_dev_run`` (a debugging run of a few batches)
    is let through.
    """
    limit = getattr(trainer, "limit_train_batches", 1.0)
    if world_size <= 1 or getattr(trainer, "fast_dev_run", False):
        return
    if (isinstance(limit, float) and limit == 1.0) or (limit == 0 and not isinstance(limit, bool)):
        return
    raise ValueError(
        f"abs_sgd: Trainer(limit_train_batches={limit!r}) counts each rank's own batches, and each rank runs as "
        "many batches as its speed allows, while abs_sgd ends every rank's epoch at the round that completes the "
        "dataset's samples: the ranks' epochs would end at different rounds. Limit the data instead (a "
        "torch.utils.data.Subset of the dataset), or the fit with max_steps (rounds) or max_epochs"
    )


def closes_round(counted: int, samples: int, others: int, target: int) -> bool:
    """A synchronous round that closes on samples (``AdaptiveBatchSize(arrival="samples")``): whether the rank that
    has just counted a micro-batch of ``samples`` arrives with it, the round's count now ``counted`` (every rank's
    micro-batches so far), ``others`` the other ranks' micro-batch sizes summed, ``target`` the round's samples
    (``sync_round_samples``, ``R``): when arriving now brings the round nearer to ``R`` than one more micro-batch
    here would,

        counted + others + samples / 2 >= R.

    When the first rank arrives, every other rank's next count closes (it exceeds this one by at least its own
    micro-batch, and ``b_j + sum_{k != j} b_k + b_j / 2`` is past the threshold): a round arriving now holds
    ``counted + others``, one more micro-batch here adds ``samples``. So, with every rank's micro-batches at
    the sizes given, a round holds at least ``R - samples / 2`` (this rule) and less than ``R + b / 2``, ``b``
    the micro-batch counted just before (its rank did not arrive): ``R`` to within half the largest
    micro-batch, or one micro-batch per rank where those alone reach about ``R``. Not so: each epoch's and
    the fit's last round (every rank arrives with its last batch), and the rounds whose micro-batches were
    drawn before the sizes were set (Lightning fetches a batch ahead; more with a ``DataLoader``'s workers)."""
    return 2 * (counted + others) + samples >= 2 * target


class ABSSGDStrategy(PartialStrategy[DelayedAllreduce]):
    """ABS-SGD over :class:`~lightning_partial.collectives.delayed.DelayedAllreduce` (see the module docstring).

    Args:
        trigger: what starts a round: ``"samples"`` (default) or ``"time"``.
        target_samples: ``"samples"``: the samples a rank accumulates before it
            requests a round; default: its micro-batch size (the fastest rank's
            every micro-batch starts a round).
        interval: ``"time"``: seconds between a rank's contributions.
        reference_samples: ``"global_batch"`` (default): ``B`` below is the
            global batch of a synchronous step: the sum of the ranks' train-loader
            batch sizes at the start of fit, agreed by one allreduce (the world size
            times the batch size, what DDP steps with, when they are equal).
            An integer ``B``: the sample-weighted mean gradient is scaled by the
            round's samples over ``B`` (the update is ``lr * sum_i G_i / B``),
            the linear scaling rule per round: a round of fewer samples than a
            synchronous step takes a proportionally smaller step, so the learning
            rate tuned for DDP stays right; an asynchronous round of more than ``B``
            samples (a long ``interval``) counts as ``B``, its mean gradient, with a
            warning: its micro-batches were computed at the same weights (at most
            one update apart). ``None``: each round's update is the
            sample-weighted mean gradient whatever the round's samples (the
            paper's rule: a round of 38 samples then takes a full step, which at
            DDP's learning rate cost 25-57 points in the main job, see
            docs/staleness.md). For plain SGD this is the
            learning rate scaled per round (weight decay excepted); with momentum
            each round's gradient enters the buffer scaled; Adam-like optimizers
            normalise a constant scale away, not one that varies by round.
            Gradient clipping sees the scaled gradient. Checkpoints keep the
            results not yet applied as they were computed.
        step_samples: ``"global_batch"`` (default): the optimizer steps once the
            rounds applied since its last step hold about the global batch of a
            synchronous step (as ``reference_samples``; where the step ends:
            ``step_boundary``), on their gradient sum over ``reference_samples``
            (with ``reference_samples=None``: over their samples). An integer:
            about that many samples. ``None``: one step
            per round (the paper's rule). Whatever is accumulated at the end of fit
            is stepped then; checkpoints keep it. Costs two parameter-sized buffers
            (the sum, and the last step's gradient, reused for the next sum).
        step_boundary: where a step of ``step_samples`` ends, as rounds come in
            units of several micro-batches: ``"nearest"`` (default): at the round
            that brings the step's samples nearest to ``step_samples`` (the next
            round assumed as large as the last: the decision is the same on every
            rank), so the steps hold about DDP's batch and are about as many;
            ``"at_least"``: at the first round that reaches them (steps a quarter
            larger and a fifth fewer under persistent heterogeneity, which with
            every step a round late cost progress per sample; docs/staleness.md).
        staleness_rule: how a step's gradient, applied one round late, enters the optimizer.
            ``"auto"`` (default): ``"momentum"`` with ``torch.optim.SGD`` and momentum
            ``mu``, and with ``torch.optim.Adam`` or ``AdamW`` (``mu = beta1``);
            otherwise ``"none"``. ``"momentum"`` (spike compensation): under SGD the
            result ``g`` enters the momentum buffer as ``mu * g`` (the share the
            buffer would still hold had it been applied on time) and the rest is
            applied at once as a plain step, ``lr * (1 - dampening) * g``, right after
            ``optimizer.step()``; under Adam and AdamW the step takes ``g`` whole and
            the first moment is then left holding ``beta1`` of its share, the rest
            applied at once with the step's own scale ``lr / (sqrt(v) + eps)``
            (:func:`~lightning_partial.strategies.compensation.retime_adam`). The total
            effect of every result equals the on-time one; only its first share comes
            a round late. On a quadratic with ``mu = 0.9`` this raises SGD's largest
            stable learning rate 2.5-fold over feeding the late result whole (see
            :mod:`lightning_partial.collectives.staleness`); under AdamW it recovers
            part of the accuracy the delay costs (measured in docs/staleness.md).
            Gradient clipping sees the gradient as stepped; the compensation follows
            the clipped one. A fit's first step from a fresh optimizer is on time (no
            step came between its micro-batches and it): fed whole, not compensated.
            Refused for other optimizers (NAdam's, RAdam's or RMSprop's steps have no
            such share).
            ``"inverse"``: the result is halved (weight ``1 / (1 + 1)``).
            ``"none"``: every result whole (the paper's rule).
        weight_prediction: ``True`` (default): each micro-batch's gradient is
            computed at the weights it will be applied to, predicted as the current
            weights plus the last round's update (linear weight prediction for a
            delay of one round); the weights are restored from a copy afterwards,
            so replicas stay bit-identical. Costs two parameter-sized buffers (the
            last update, and the weights' copy during a micro-batch). Works with any optimizer. ``False``: the gradient of
            the current weights (the paper's rule).
        final_sync: the fraction of the fit, at its end, run as synchronous rounds
            (see the module docstring): of the global samples ``max_epochs`` make, or
            of ``max_steps`` rounds. ``0.05`` (default); ``0``: the paper's rounds to
            the end. In ``[0, 1)``. A fit with neither bound runs without it (a warning).
            Nothing to do with ``delay=0``.
        delay: the rounds a result waits before it is applied: ``1`` (the paper's
            one-round delay), ``0`` (synchronous rounds throughout, each result applied as
            the round completes; pair it with ``AdaptiveBatchSize`` under heterogeneous ranks, or the
            slowest rank's micro-batch paces every round), or ``"auto"`` (default):
            ``0`` when every optimizer is Adam-like (``torch.optim.Adam``, ``AdamW``
            and others with ``betas``) or an ``AdaptiveBatchSize`` callback is in the
            fit (persistent speeds, which its sizes follow), ``1`` otherwise. Measured
            in docs/staleness.md (abs_sgd without the delay).
        overlap_arrival: ``True`` (default): in synchronous rounds whose arrivals are not in lock-step
            (``AdaptiveBatchSize(arrival="samples")`` or ``"time"``), a rank that arrives does not wait for the
            round: it computes its next micro-batch while the round's allreduce runs and the other ranks finish
            theirs, and applies the round's result after it (``DelayedAllreduce.deposit(wait=False)``). That
            micro-batch's gradient lacks the round's update (computed at the predicted weights where
            ``weight_prediction`` is on) and joins the next round; every other gradient stays fresh. Such a round
            counts towards an epoch's or the fit's end once handed, the same on every rank. ``False``: every arrival
            waits for its round (every gradient fresh). Measured in docs/staleness.md (overlapped arrivals).
        shuffle, seed: the elastic sampler's shuffling (as ``DistributedSampler``'s); a train loader
            built with ``shuffle=False`` keeps its order. ``seed=None`` (default): the seed of the
            ``DistributedSampler`` it replaces, which Lightning seeds by ``seed_everything``
            (``PL_GLOBAL_SEED``, 0 without it) as under DDP, so that a fit's seed changes its data order.
        find_unused_parameters: a parameter that no micro-batch of an optimizer step used, on any rank,
            keeps ``grad = None`` in that step (no momentum, no weight decay), as DDP's option of that
            name; its presence rides beside the gradients (one number per parameter tensor). Without it
            (default) a missing gradient counts as zeros.
        timeout, collective_timeout, process_group_backend, start_method: as for every strategy here.
    """

    strategy_name = "abs_sgd"
    lockstep = False  # a rank applies a round in its own batch: validation at epoch ends only
    finish_by_time = False  # its finish is counted in global samples or rounds (max_time ends the fit only)
    registry_entries = (("abs_sgd", "ABS-SGD: delayed synchronous SGD with adaptive batch sizes", {}),)
    engine_family = "abs_sgd"  # pending gradient sums with sample counts, unapplied results

    def __init__(
        self,
        *,
        trigger: str = "samples",
        target_samples: Optional[int] = None,
        interval: Optional[float] = None,
        reference_samples: Union[int, str, None] = "global_batch",
        step_samples: Union[int, str, None] = "global_batch",
        step_boundary: str = "nearest",
        staleness_rule: str = "auto",
        weight_prediction: bool = True,
        final_sync: float = 0.05,
        delay: Union[int, str] = "auto",
        overlap_arrival: bool = True,
        shuffle: bool = True,
        seed: Optional[int] = None,
        find_unused_parameters: bool = False,
        **kwargs: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**kwargs)
        if trigger not in TRIGGERS:
            raise ValueError(f"abs_sgd: unknown trigger {trigger!r}: expected one of {', '.join(TRIGGERS)}")
        self.trigger = cast(Trigger, trigger)
        self.target_samples = target_samples
        self.interval = interval
        if isinstance(reference_samples, str) and reference_samples != GLOBAL_BATCH:
            raise ValueError(
                f"abs_sgd: reference_samples must be an integer >= 1, {GLOBAL_BATCH!r} or None, got {reference_samples!r}"
            )
        self.reference_samples = reference_samples
        if step_samples is not None and step_samples != GLOBAL_BATCH and not is_int_at_least(step_samples, 1):
            raise ValueError(
                f"abs_sgd: step_samples must be an integer >= 1, {GLOBAL_BATCH!r} or None, got {step_samples!r}"
            )
        self.step_samples = step_samples
        self.step_boundary = check_boundary(step_boundary, owner=self.strategy_name)
        # Holds tensors only during a fit (and a checkpoint's until train start): pickle-safe before it.
        self._accumulator = RoundAccumulator(step_samples=None, reference_samples=None, boundary=step_boundary)
        self._warned_capped = False  # an asynchronous round larger than reference_samples (warned once per fit)
        # Validated now; at set-up the target defaults to the micro-batch size and the reference to
        # the global batch (neither known yet: 1 stands in).
        self._delayed_config(target_samples=1 if target_samples is None and trigger == "samples" else target_samples,
                             reference_samples=1 if reference_samples == GLOBAL_BATCH else reference_samples)
        if not isinstance(shuffle, bool):
            raise ValueError(f"{self.strategy_name}: shuffle must be True or False, got {shuffle!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError(f"{self.strategy_name}: seed must be an integer or None, got {seed!r}")
        self.shuffle = shuffle
        self.seed = seed
        self._set_find_unused_parameters(find_unused_parameters)
        self._accumulator.presence = find_unused_parameters  # its rounds carry the presence numbers too
        self.staleness_rule = compensation.check_rule(staleness_rule, owner=self.strategy_name)
        self._set_weight_prediction(weight_prediction)
        self._set_final_sync(final_sync)
        if not ((type(delay) is int and delay in DELAYS) or delay == "auto"):
            raise ValueError(f"{self.strategy_name}: delay must be 0, 1 or 'auto', got {delay!r}")
        self.delay = delay
        if not isinstance(overlap_arrival, bool):
            raise ValueError(f"{self.strategy_name}: overlap_arrival must be a bool, got {overlap_arrival!r}")
        self.overlap_arrival = overlap_arrival
        self._delay: Optional[int] = None  # resolved at set-up (from the optimizers under "auto")
        self.sampler: Optional[ElasticBatchSampler] = None
        #: Every rank's loader batch size at the start of this fit (agreed when the engines start: one
        #: all_gather on the collective group); ``AdaptiveBatchSize`` sizes every rank from them.
        self.loader_batch_sizes: Optional[tuple[int, ...]] = None
        # A DataLoader(batch_sampler=ElasticBatchSampler(...)) of the user's and its batch size before this fit
        # (AdaptiveBatchSize resizes it; teardown restores it, so the next fit starts from the user's size).
        self._user_sampler: Optional[tuple[ElasticBatchSampler, int]] = None
        self._epoch_samples: Optional[int] = None
        self._batch_samples = 0
        self._last_rounds: dict[int, int] = {}  # agreed at the end of fit
        self._handed_rounds: dict[int, int] = {}  # the largest round any rank was handed: agreed with them
        # The save boundary of the latest batch that ended an epoch or the fit (see on_train_end).
        self._end_boundary: Optional[int] = None
        # The ModelCheckpoint(every_n_train_steps=n) callbacks this strategy triggers.
        self._step_checkpoints: list[_StepCheckpoint] = []
        # Every ModelCheckpoint of this fit (their epoch-end hooks run as on rank 0; given back at teardown).
        self._checkpoints: list[ModelCheckpoint] = []
        #: Micro-batches per synchronous round (``AdaptiveBatchSize`` sets it at the same round on every rank, to
        #: the same value; main thread only): by count, the first ``n - 1`` of each round are deposited without
        #: arriving, so the ranks' batches stay in lock-step and a per-batch collective pairs the same batches;
        #: nominal under ``round_fill`` or ``round_seconds``.
        self.micro_batches_per_round = 1
        #: Seconds of work per synchronous round (``AdaptiveBatchSize(arrival="time")`` sets it at the same round
        #: on every rank, to the same value; main thread only): a rank arrives with the micro-batch whose end is
        #: nearest to it, whatever ``micro_batches_per_round`` says. ``None``: by samples or by count.
        self.round_seconds: Optional[float] = None
        #: Every rank's micro-batch size in synchronous rounds that close on samples
        #: (``AdaptiveBatchSize(arrival="samples")`` sets it at the same round on every rank, to the same value;
        #: main thread only): a rank arrives with the micro-batch that brings the round nearest to
        #: ``sync_round_samples``, counted over every rank in the store (``_arrives_by_samples``). ``None``: not so.
        self.round_fill: Optional[tuple[int, ...]] = None
        #: The samples AdaptiveBatchSize makes a synchronous round hold (resolved at the start of fit).
        self.sync_round_samples: Optional[int] = None
        #: Whether a hook run at every batch (the training step's closure, ``on_train_batch_end``, ...) issued one
        #: of the strategy's collectives in this fit (main thread only; see ``_before_collective``):
        #: ``AdaptiveBatchSize(arrival="samples"|"time")`` then arrives by count.
        self.batch_collectives = False
        self._in_closure = False
        self._held: dict[int, int] = {}  # per optimizer: micro-batches deposited since this rank last arrived
        # The batch now starting ends the epoch or the fit: True, it arrives whatever n is; False, it does not
        # (the epoch ends before the synchronous finish begins); None: by n (``_epoch_end_arrival``).
        self._arrive_now: Optional[bool] = None
        #: How many optimizer steps late this rank's micro-batches are applied (a diagnostic: StalenessTracker
        #: logs it as partial/step_lag; main thread only).
        self.step_lags = StepLag()

    # ---------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn != pl.trainer.states.TrainerFn.FITTING:
            return
        assert self.lightning_module is not None
        _compat.forget_current_hook(self.lightning_module)  # Lightning calls setup outside every hook
        if not self.lightning_module.automatic_optimization:
            raise ValueError("abs_sgd needs automatic optimization: it decides when the optimizer steps")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"abs_sgd accumulates micro-batches itself: Trainer(accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches}) must be 1"
            )
        check_validation_schedule(trainer)
        check_batch_limits(trainer, world_size=self.world_size)
        if is_overridden("optimizer_step", self.lightning_module, pl.LightningModule):
            # Lightning calls it once per batch, keyed by the batch's global step; here a batch is a
            # micro-batch that takes zero, one or several optimizer steps, each rank in its own batches.
            raise ValueError(
                f"abs_sgd: {type(self.lightning_module).__name__}.optimizer_step is overridden; Lightning calls it "
                "once per batch, and under abs_sgd a batch is a micro-batch that takes zero, one or several "
                "optimizer steps, each rank in its own batches, so what it does per step (a warm-up from "
                "trainer.global_step) would differ between the ranks and the replicas would drift apart. Set the "
                "learning rate in on_before_optimizer_step (it runs before every optimizer step, with "
                "trainer.global_step counting the steps) or use an LR scheduler with interval='step'"
            )
        if trainer.min_steps:
            # Lightning holds a stop back while the rank's *own* global_step is below min_steps.
            raise ValueError(
                f"abs_sgd: Trainer(min_steps={trainer.min_steps}) holds a stop (EarlyStopping, should_stop) back "
                "until each rank's own global step reaches it, and the ranks reach a step in different batches, "
                "so the fit would end on some ranks and go on on others. Use min_epochs: epoch ends are the same "
                "round on every rank"
            )
        for config in trainer.lr_scheduler_configs:
            if config.reduce_on_plateau and config.interval == "step":
                raise ValueError(
                    f"abs_sgd: a ReduceLROnPlateau with interval='step' steps after every batch on the metric "
                    f"{config.monitor!r} of that rank's own micro-batch, and each rank runs as many batches as its "
                    "speed allows, so the ranks' learning rates would differ and the replicas drift apart. Use "
                    "interval='epoch' (epoch ends are the same round on every rank)"
                )
        self._staleness = compensation.resolve_all(self.staleness_rule, self.optimizers, owner=self.strategy_name,
                                                   spike=True)
        self._delay = self._resolve_delay(trainer)
        self._step_checkpoints = []
        self._checkpoints = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
        for cb in self._checkpoints:
            # A rank ends an epoch at its own global step: the epoch-end saves are decided as on rank 0.
            _compat.agree_epoch_end_checkpoints(cb)
            every = _compat.take_over_step_checkpoints(cb)
            if every:
                self._step_checkpoints.append(_StepCheckpoint(cb, every))
        if not any(isinstance(cb, _EpochEndSaves) for cb in trainer.callbacks):
            trainer.callbacks.append(_EpochEndSaves(self))  # removed at teardown

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Replaces the train loader's ``DistributedSampler`` by an :class:`ElasticBatchSampler`."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
            return dataloader
        batch_sampler = dataloader.batch_sampler
        # A reload (reload_dataloaders_every_n_epochs) in this fit keeps the size AdaptiveBatchSize set.
        adapted = self.sampler.batch_size if self._engines and self.sampler is not None else None
        if isinstance(batch_sampler, ElasticBatchSampler):
            if self._user_sampler is None or self._user_sampler[0] is not batch_sampler:
                self._user_sampler = (batch_sampler, batch_sampler.batch_size)
            self.sampler = batch_sampler
        else:
            sampler = getattr(batch_sampler, "sampler", None)
            if not isinstance(sampler, DistributedSampler) or dataloader.batch_size is None:
                raise ValueError(
                    "abs_sgd gives fast ranks more samples than slow ones, so it replaces the train loader's "
                    "DistributedSampler: use a map-style dataset with a batch_size and "
                    "Trainer(use_distributed_sampler=True) (the default), or pass "
                    "DataLoader(batch_sampler=lightning_partial.data.ElasticBatchSampler(...))"
                )
            if type(sampler) is not DistributedSampler:
                # Lightning wraps a user's own sampler (DistributedSamplerWrapper): an elastic sampler
                # cannot draw what it would draw, and dropping it silently would train other samples.
                inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
                what = type(inner).__name__ if inner is not None else type(sampler).__name__
                raise ValueError(
                    f"abs_sgd gives fast ranks more samples than slow ones, so it replaces the train loader's "
                    f"sampler, and cannot keep this one ({what}): use DataLoader(shuffle=True or False) with "
                    "Trainer(use_distributed_sampler=True), or pass "
                    "DataLoader(batch_sampler=lightning_partial.data.ElasticBatchSampler(...))"
                )
            self.sampler = ElasticBatchSampler(
                len(cast(Sized, dataloader.dataset)),  # a map-style dataset: the sampler has the check
                batch_size=dataloader.batch_size,
                num_replicas=self.world_size,
                rank=self.global_rank,
                # DataLoader(shuffle=False) keeps its order, as Lightning's DistributedSampler would.
                shuffle=self.shuffle and sampler.shuffle,
                # None: the replaced sampler's, which Lightning seeds by seed_everything, as DDP's.
                seed=self.seed if self.seed is not None else sampler.seed,
            )
            extra: dict[str, Any] = {}
            if dataloader.num_workers > 0:
                extra = {"prefetch_factor": dataloader.prefetch_factor, "persistent_workers": dataloader.persistent_workers}
            dataloader = DataLoader(
                dataloader.dataset,
                batch_sampler=self.sampler,
                num_workers=dataloader.num_workers,
                collate_fn=dataloader.collate_fn,
                pin_memory=dataloader.pin_memory,
                timeout=dataloader.timeout,
                worker_init_fn=dataloader.worker_init_fn,
                multiprocessing_context=dataloader.multiprocessing_context,
                generator=dataloader.generator,
                **extra,
            )
        if adapted is not None:
            self.sampler.batch_size = adapted
        self._epoch_samples = self.sampler.num_samples
        return dataloader

    def _agree_loaders(self) -> tuple[int, ...]:
        """Every rank, main thread, collective group, once per fit: every rank's loader batch size.

        One all_gather of ``(batch size, epoch samples, shuffle, seed)``. The epoch (the dataset's length) must
        be the same on every rank: the ranks end their epochs, and start the synchronous finish, at the same
        round only if they count to the same global samples. So must the order: each rank draws from its own
        shard of one permutation of the dataset per epoch, and ranks seeded differently
        (``seed_everything(seed + rank)``, which ``seed=None`` follows) would draw overlapping shards (DDP's
        sampler takes such shards without a word). Raises a ``ValueError`` naming the ranks' values if either
        differs.
        """
        assert self.sampler is not None
        sampler = self.sampler
        mine = torch.tensor([sampler.batch_size, sampler.num_samples, int(sampler.shuffle),
                             sampler.seed % (1 << 63) if sampler.shuffle else 0], dtype=torch.int64)
        rows = [mine]
        if self.world_size > 1:
            rows = [torch.zeros_like(mine) for _ in range(self.world_size)]
            what = "abs_sgd: agreeing on the ranks' loaders (batch sizes and epoch lengths) at the start of fit"
            with naming_failure(what, rank=self.global_rank, round_index=0):  # bounded by the group's timeout
                dist.all_gather(rows, mine, group=self.collective_group)
        lengths = [int(r[1]) for r in rows]
        if len(set(lengths)) > 1:
            each = ", ".join(f"rank {i}: {n}" for i, n in enumerate(lengths))
            raise ValueError(
                f"abs_sgd: the ranks' train datasets differ in length ({each} samples): an epoch must be the "
                "same global samples on every rank"
            )
        orders = [(bool(r[2]), int(r[3])) for r in rows]
        if len(set(orders)) > 1:
            each = ", ".join(f"rank {i}: " + (f"seed {seed}" if shuffle else "no shuffle")
                             for i, (shuffle, seed) in enumerate(orders))
            raise ValueError(
                f"abs_sgd: the ranks' samplers would draw different orders ({each}): the ranks share one "
                "permutation of the dataset per epoch. Seed every rank alike (seed_everything(s) on every "
                "rank) or pass ABSSGDStrategy(seed=...)"
            )
        return tuple(int(r[0]) for r in rows)

    def _delayed_config(self, target_samples: Optional[int], reference_samples: Any, **fit: Any) -> DelayedConfig:
        """The engine's configuration from this strategy's options and ``fit``'s (epochs, rounds, name)."""
        return DelayedConfig(
            trigger=self.trigger,
            target_samples=target_samples,
            interval=self.interval,
            reference_samples=reference_samples,
            timeout=self._timeout,
            collective_timeout=self._collective_timeout,
            **fit,
        )

    @override
    def _build_engine(self, index: int, params: list[torch.nn.Parameter], store: dist.Store) -> DelayedAllreduce:
        trainer = self._trainer
        if self.sampler is None:
            raise RuntimeError("abs_sgd: the train dataloader was not prepared (process_dataloader)")
        target = self.target_samples
        if self.trigger == "samples" and target is None:
            target = self.sampler.batch_size
        reference, step = self.reference_samples, self.step_samples
        if not self._engines:  # the fit's first engine (an optimizer without trainable parameters has none)
            self.loader_batch_sizes = self._agree_loaders()
        assert self.loader_batch_sizes is not None
        global_batch: Optional[int] = None
        if GLOBAL_BATCH in (reference, step):
            # Every rank must divide by (and step at) the same B: the sum of the ranks' loader batch sizes.
            # World size x batch size when the sizes are equal; per-rank loaders may differ.
            global_batch = sum(self.loader_batch_sizes)
        reference = global_batch if reference == GLOBAL_BATCH else reference
        self._accumulator.step_samples = global_batch if step == GLOBAL_BATCH else cast(Optional[int], step)
        self._accumulator.reference_samples = cast(Optional[int], reference)
        if index == 0:
            # What AdaptiveBatchSize splits among the ranks in synchronous rounds: a step's samples, so that
            # a synchronous round is one step (one allreduce), as DDP's; None: no such size is configured.
            self.sync_round_samples = self._accumulator.step_samples or cast(Optional[int], reference)
        max_epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        max_rounds = trainer.max_steps if trainer.max_steps > 0 else None
        config = self._delayed_config(
            target,
            reference,
            epoch_samples=self._epoch_samples,
            max_epochs=max_epochs,
            max_rounds=max_rounds,
            name=f"abs_sgd-{index}",
            **({"sync_from": 0} if self._delay == 0 else self._finish_thresholds(max_epochs, max_rounds)),
        )
        return DelayedAllreduce(config, store=store, rank=self.global_rank, world_size=self.world_size,
                                like=self._with_presence([p.detach() for p in params], params))

    def _resolve_delay(self, trainer: "pl.Trainer") -> int:
        """``delay`` for this fit: ``"auto"`` is 0 when every optimizer is Adam-like or an ``AdaptiveBatchSize``
        is among the callbacks (set-up, main thread)."""
        from lightning_partial.callbacks.adaptive_batch_size import AdaptiveBatchSize

        adaptive = any(isinstance(cb, AdaptiveBatchSize) for cb in trainer.callbacks)
        if self.delay == "auto":
            adam_like = bool(self.optimizers) and all(compensation.is_adam_like(opt) for opt in self.optimizers)
            delay = 0 if adam_like or adaptive else 1
        else:
            delay = int(self.delay)
        if delay == 0 and self.global_rank == 0 and (self.trigger != "samples" or self.target_samples is not None):
            # Synchronous rounds start when every rank arrives: what starts an asynchronous round does not apply.
            why = f"delay={self.delay!r}" + (" (resolved to 0)" if self.delay == "auto" else "")
            log.warning(
                "abs_sgd: trigger=%r, target_samples=%r and interval=%r have no effect with %s: every round is "
                "synchronous; pass delay=1 for the paper's delayed rounds", self.trigger, self.target_samples,
                self.interval, why,
            )
        if delay == 0:
            if self.world_size > 1 and self.global_rank == 0 and not adaptive:
                log.warning(
                    "abs_sgd: delay=0 (synchronous rounds%s): every rank's micro-batch joins every round, so the "
                    "slowest rank paces them; add lightning_partial.callbacks.AdaptiveBatchSize to size each "
                    "rank's micro-batch to its speed", " under an Adam-like optimizer" if self.delay == "auto" else "",
                )
        return delay

    def _finish_thresholds(self, max_epochs: Optional[int], max_rounds: Optional[int]) -> dict[str, Optional[int]]:
        """The engine's ``sync_from_samples`` and ``sync_from`` for ``final_sync`` (empty when it is off)."""
        if not self.final_sync:
            return {}
        owner, rank = self.strategy_name, self.global_rank
        finish: dict[str, Optional[int]] = {}
        if max_epochs is not None and self._epoch_samples is not None:
            finish["sync_from_samples"] = first_sync_round(self.final_sync, max_epochs * self._epoch_samples,
                                                           owner=owner, rank=rank, unit="global samples")
        if max_rounds is not None:
            finish["sync_from"] = first_sync_round(self.final_sync, max_rounds, owner=owner, rank=rank, unit="rounds")
        if not finish:
            first_sync_round(self.final_sync, None, owner=owner, rank=rank, unit="global samples or rounds")  # warns
        return finish

    @override
    def _engine_state(self, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """Own pending sums (old rank ``j``'s go to ``j % P``); rank 0's unapplied results, samples and the rounds'
        decisions (where the epochs ended, where the finish began).

        The restored weights are rank 0's, so the results rank 0 had not applied
        are those every rank must apply.
        """
        if len(per_rank) == self.world_size:
            own = per_rank[self.global_rank]
            base = dict(own)
        else:
            base = state_for_rank(per_rank, rank=self.global_rank, world_size=self.world_size)
            mine = [s for j, s in enumerate(per_rank) if j % self.world_size == self.global_rank]
            base["pending_samples"] = [n for s in mine for n in s.get("pending_samples", [])]
            base["pending_first"] = [n for s in mine for n in s.get("pending_first", [])]
        # What the rounds decided, the same in every rank's state: taken from rank 0's on any world size (the
        # rounds that ended epochs, where the finish began: docs/algorithms.md, abs_sgd's checkpoints).
        base["unapplied"] = per_rank[0].get("unapplied", [])
        base["global_samples"] = per_rank[0].get("global_samples", 0)
        for key in ("sync_from", "epoch_end_rounds"):
            if key in per_rank[0]:
                base[key] = per_rank[0][key]
        return base

    @override
    def _fit_states(self) -> list[FitState]:
        """Weight prediction's, and the rounds accumulated since the last step (saved, resumed, reset per fit)."""
        return [*super()._fit_states(), self._accumulator]

    @override
    def update_rule(self) -> dict[str, Any]:
        """The base class's, ``step_samples`` as configured (``"global_batch"``, an integer, or ``None``),
        ``step_boundary``, ``delay`` (resolved: 0 or 1; as configured before set-up) and ``overlap_arrival``.
        With ``delay=0`` what is in force: ``final_sync`` 1.0 (every round synchronous) and ``staleness_rule``
        ``"none"`` (no result is late; with ``overlap_arrival``, one micro-batch per rank and round is a step late,
        taken whole: ``partial/step_lag`` shows it)."""
        rule = {**super().update_rule(), "step_samples": self.step_samples, "step_boundary": self.step_boundary,
                "delay": self.delay if self._delay is None else self._delay, "overlap_arrival": self.overlap_arrival}
        if self._delay == 0:
            rule["final_sync"] = 1.0
            if "staleness_rule" in rule:
                rule["staleness_rule"] = "none"
        return rule

    # ------------------------------------------------------------- training
    @override
    def _stop_now(self) -> bool:
        """Not at a batch that ends this rank's epoch: a rank handed the epoch's last round and the stop round
        in one batch runs that last batch and the epoch-end hooks (validation, epoch-end checkpoints: collective),
        as a rank that saw the epoch end before the stop reached it does, and stops at the next batch start."""
        engine = self._engines.get(0)
        if (self._stopped and engine is not None
                and engine.progress().epochs_completed > self._trainer.current_epoch):
            return False
        return super()._stop_now()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The agreed stop (Lightning before 2.6); records the micro-batch's samples; ends the epoch (or the
        fit) where the rounds say so."""
        self._check_stop_at_batch_start()
        self._batch_samples = int(extract_batch_size(batch))
        self._arrive_now = None
        engine = self._engines.get(0)
        if engine is None:
            return
        if batch_idx == 0:
            # The epoch's end (validation, hooks, the loader's start) is no micro-batch's work: counted as
            # busy it would read as a slow window, and under AdaptiveBatchSize(arrival="time") lengthen the
            # rounds' time by it.
            for each in self._engines.values():
                each.restart_work_clock()
        trainer = self._trainer
        self._save_boundary = self._last_batch(engine.progress(), trainer.current_epoch)[1]
        super().on_train_batch_start(batch, batch_idx)  # the queued saves (step and time), in round order
        # A save lets rounds complete: asked again, and decided from one reading of the engine.
        progress = engine.progress()
        ends, self._save_boundary = self._last_batch(progress, trainer.current_epoch)
        if ends is not None:
            self._end_boundary = self._save_boundary  # where the fit ends if it ends after this batch
            _compat.mark_last_batch(trainer)
            self._arrive_now = self._epoch_end_arrival(ends, progress, self._save_boundary)
            if ends == "fit":
                trainer.should_stop = True

    def _run_closure(self, closure: Callable[[], Any]) -> Any:
        """The micro-batch's closure (``training_step``, its backward and their hooks), marked for
        :meth:`_before_collective`."""
        self._in_closure = True
        try:
            return closure()
        finally:
            self._in_closure = False

    @property
    def _arrivals_out_of_step(self) -> bool:
        """Synchronous rounds whose arrivals are by samples (``round_fill``) or by time (``round_seconds``): the ranks
        run different numbers of batches per round (main thread)."""
        return self.round_fill is not None or self.round_seconds is not None

    @override
    def _before_collective(self, what: str) -> None:
        """A collective issued in a hook that runs at every batch: the training step's closure
        (``training_step``, ``on_before_backward``, ``on_after_backward``) or a module's or callback's
        ``on_train_batch_start``, ``on_train_batch_end``, batch transfer hooks (``_BATCH_HOOKS``;
        ``self.log(..., sync_dist=True)`` on step, ``all_gather``, a barrier). It pairs the same batch on every
        rank only while the ranks run their batches in lock-step: every round synchronous (``delay=0``), each
        rank arriving after the same number of micro-batches. One in a hook run at every optimizer step
        (``on_before_optimizer_step``, ``configure_gradient_clipping``, ``lr_scheduler_step``: ``_STEP_HOOKS``)
        pairs while every round is synchronous, and is refused under ``delay=1`` only. Recorded (``batch_collectives``:
        ``AdaptiveBatchSize(arrival="samples"|"time")`` then arrives by count; its first window runs in
        lock-step, so every rank records the same) and refused otherwise, before this rank enters the
        collective (the others fail through the engine when it stops), so the fit fails at once rather than in
        a wait for a batch another rank never runs (until ``timeout``). The strategy's own saves, which every
        rank runs at the same round whichever hook runs them, pass; so does everything at epoch ends,
        validation and checkpoints outside them. One rank pairs with itself: nothing to check."""
        if self._running_saves or self.world_size < 2:
            return
        # The hook's name only while this fit's engines run (train start to end): Lightning leaves the name of
        # a hook that raised on the module, which a later validate or fit would read here.
        hook = None if self._in_closure or not self._engines else _compat.current_hook(self.lightning_module)
        if hook in _STEP_HOOKS and self._delay == 0:
            return  # a round's step: every rank applies every round in order (see _STEP_HOOKS)
        if not self._in_closure and (hook not in _BATCH_HOOKS | _STEP_HOOKS or not self._trainer.training):
            return  # epoch ends, checkpoints, validation: points every rank reaches at the same round
        self.batch_collectives = True
        if self._delay == 0 and not self._arrivals_out_of_step:
            return
        why = ("delay=1, the rounds asynchronous" if self._delay != 0 else
               "AdaptiveBatchSize(arrival='time'), each rank arriving after about the round's time of work"
               if self.round_seconds is not None else
               "AdaptiveBatchSize(arrival='samples'), each rank arriving once the round holds about its samples")
        where = ("a training step (training_step, backward and their hooks)" if hook is None else
                 f"{hook} (a hook run at every optimizer step)" if hook in _STEP_HOOKS else
                 f"{hook} (a hook run at every batch)")
        last = self._last_round()
        when = "before the first round" if last is None else f"round {last} applied"
        raise RuntimeError(
            f"abs_sgd: {what} in {where} on rank {self.global_rank} (epoch {self._trainer.current_epoch}, {when}):"
            f" with {why}, the ranks run different numbers of batches, so a collective issued per batch cannot"
            " pair the same batch on every rank. Log per rank (sync_dist=False) or per epoch (on_step=False,"
            " on_epoch=True: reduced at the epoch end, which every rank reaches at the same round); save with"
            " ModelCheckpoint(every_n_train_steps=..., or train_time_interval=...), which the strategy runs at the"
            " same round on every rank, or at epoch ends; or run the batches in lock-step: delay=0 (with"
            " AdaptiveBatchSize(arrival='count') if any)"
        )

    @staticmethod
    def _last_batch(progress: RoundProgress, epoch: int) -> tuple[Optional[str], Optional[int]]:
        """Whether the batch now starting ends this rank's epoch ``epoch`` (``"epoch"``) or the fit (``"fit"``),
        and the round before which the queued saves run at this batch's start and end (``None``: all).

        The epoch ends first where its last round ``E`` comes before the fit's ``F`` (a time limit or
        ``max_steps`` just after an epoch end): every rank then ends epoch ``epoch`` at ``E`` and the fit at
        ``F``, however far behind it saw them. A synchronous round is applied by every rank in the batch that
        arrives at it, before any rank's last batch: no boundary then.
        """
        end_epoch = progress.epochs_completed > epoch
        last = progress.epoch_end_rounds.get(epoch) if end_epoch else None
        final = progress.final_round
        if end_epoch and (final is None or (last is not None and last < final)):
            ends, boundary = "epoch", last
        elif final is not None:
            ends, boundary = "fit", final
        else:
            return None, None
        if boundary is not None and progress.is_synchronous(boundary):
            boundary = None
        return ends, boundary

    @staticmethod
    def _epoch_end_arrival(ends: str, progress: RoundProgress, boundary: Optional[int]) -> bool:
        """Whether an epoch's (or the fit's) last batch arrives at the synchronous round its micro-batch lands in.

        The epoch-end hooks after it may be collective (a checkpoint, validation): no rank may wait in a
        round then for a rank that is in those hooks. Where the epoch's last round ``E`` is synchronous, or
        the last asynchronous one (the finish begins at ``E + 1``), every rank's last batch lands in the
        same synchronous round: every rank arrives (whatever ``micro_batches_per_round`` says; one held by
        the engine at the switch arrives at the batch's end, :meth:`_saves_before_epoch_end`). Where the
        epoch ends earlier, one rank's last micro-batch may land in the first synchronous round while
        another's lands in an asynchronous one: none arrives, and every rank arrives with its next epoch's
        first. At the fit's end nothing is synchronous any more: arriving changes nothing.
        """
        if ends == "fit" or boundary is None:
            return True  # boundary None: the epoch's last round is synchronous (or unknown: resumed after it)
        return progress.sync_from is not None and boundary + 1 >= progress.sync_from

    def _saves_before_epoch_end(self) -> None:
        """Every rank, main thread, at the end of an epoch's (or the fit's) last batch, before its epoch-end
        hooks (validation, epoch-end checkpoints: collective): the saves of the rounds before the boundary
        round ``E``.

        A rank applies round ``r`` one round late, in a batch of its own: at the start of the last batch one
        rank may have applied ``E - 1`` and another not yet. By the end of that batch every rank has (round
        ``E`` had completed before it started), and none has necessarily applied ``E``: so the saves of the
        rounds before ``E`` run here on every rank, and those of ``E`` on (applied in the last batch or the
        next epoch's first) at the next epoch's batch starts, after the epoch-end hooks on every rank.
        Then, in a last batch that arrives (``_epoch_end_arrival``), the arrival the engine held, if it held one.
        """
        if self._save_boundary is not None:
            self._run_pending_saves(before=self._save_boundary)
            self._save_boundary = None
        if self._arrive_now:
            # An arrival the engine held at the switch to the synchronous finish (this rank had rounds before
            # the last asynchronous one still to apply, whose saves the others may have run already: just
            # run here): made now, before the epoch-end hooks, as the other ranks made theirs in this batch.
            for index, engine in self._engines.items():
                if engine.holding:
                    results = engine.arrive()
                    self._held[index] = 0
                    self._apply(index, self.optimizers[index], results)  # counts its steps (after this batch's)

    @override
    def _engine_step(self, index: int, optimizer: Optimizer, closure: Callable[[], Any], model: StepModel,
                     kwargs: dict[str, Any]) -> Any:
        """The micro-batch (closure), its deposit, then one optimizer step per round result now due."""
        params = self._params[index]
        engine = self._engines[index]
        # In the synchronous finish too, where the gradient is applied before any other update: there the
        # prediction is a look-ahead (as Nesterov's), as in eager_sgd's finish; measured better under AdamW
        # (docs/staleness.md, abs_sgd's finish), within noise under SGD momentum.
        prediction = self._prediction_in_force()
        steps_before = self._accumulator.steps(index)  # the weights this micro-batch's gradient is computed on
        if prediction is None:
            output = self._run_closure(closure)
        else:
            # The micro-batch's gradient is applied one round late, to weights one update further on:
            # computed there (the weights are restored exactly afterwards).
            saved = prediction.begin(index, params)
            with prediction.predicted(index, params, saved):
                output = self._run_closure(closure)
            prediction.release(index, saved)  # not held while the results are applied
        grads = self._with_presence([p.grad if p.grad is not None else torch.zeros_like(p) for p in params], params,
                                    [p.grad is not None for p in params])
        samples = max(self._batch_samples, 1)
        # In synchronous rounds every rank arrives with the last of its ``micro_batches_per_round`` (counted
        # from its first synchronous deposit: the ranks' batches stay in lock-step), or by the round's samples
        # under ``round_fill``, or by time under ``round_seconds`` (the counts differ then); the engine ignores
        # ``arrive`` in asynchronous rounds. In the finish, steps happen only at arrivals, so every rank
        # reaches a step checkpoint's save (at the next batch start) before it arrives again; at the switch,
        # the engine holds the first arrival of a rank with earlier rounds still to apply (their saves may
        # be running on the other ranks) and hands those rounds instead.
        held = self._held.get(index, 0) + 1
        if self._arrive_now is not None:
            arrive = self._arrive_now
        elif self.round_fill is not None:
            arrive = self._arrives_by_samples(engine, samples)
        elif self.round_seconds is not None:
            # By time: arriving now ends this rank's share nearer to the round's time than one more
            # micro-batch (of the mean length of this round's so far) would.
            work = engine.work_since_arrival()
            arrive = work + work / held / 2 >= self.round_seconds
        else:
            arrive = held >= self.micro_batches_per_round
        # A batch that does not end its epoch (as its start saw the rounds) gives the epoch: if the rounds end
        # it meanwhile, the next batch, which ends it, is the one that arrives (as on every other rank).
        epoch = self._trainer.current_epoch if self._arrive_now is None else None
        # Arrivals by samples or by time (not in lock-step: no per-batch collective pairs them) go on with the
        # next micro-batch while the round completes (the engine waits once a stop or the final round is known).
        go_on = self.overlap_arrival and self._arrive_now is None and self._arrivals_out_of_step
        results = engine.deposit(grads, samples=samples, arrive=arrive, epoch=epoch, wait=not go_on)
        # Counted from the last arrival (the engine may hold one it was asked to make: see its deposit()).
        self._held[index] = held if engine.holding else 0
        self.step_lags.deposited(index, engine.deposit_round, steps_before, samples)
        steps = self._apply(index, optimizer, results, model)
        _compat.add_optimizer_steps(self._trainer, -1)  # _apply counted every step; Lightning adds one now
        if not steps:
            for p in params:
                p.grad = None  # nothing was applied: leave no gradient behind
        return output

    def _arrives_by_samples(self, engine: DelayedAllreduce, samples: int) -> bool:
        """Under ``round_fill``: counts this micro-batch's ``samples`` into the round
        (``DelayedAllreduce.count_round_samples``) and decides by :func:`closes_round`. ``True`` in an asynchronous
        round (``arrive`` is ignored there)."""
        counted = engine.count_round_samples(samples)
        if counted is None:
            return True
        assert self.round_fill is not None and self.sync_round_samples is not None
        others = sum(self.round_fill) - self.round_fill[self.global_rank]
        return closes_round(counted, samples, others, self.sync_round_samples)

    def _apply(
        self, index: int, optimizer: Optimizer, results: list[RoundResult], model: StepModel = None, *,
        final: bool = False,
    ) -> int:
        """Adds each result to the accumulator, and steps the optimizer whenever a step is due; returns the steps.

        ``final`` (the end of fit): whatever the last result leaves accumulated is stepped too. Rounds
        without samples step nothing (the same on every rank: the samples come from the headers).
        """
        module = model if isinstance(model, pl.LightningModule) else self.lightning_module
        weights = self._staleness.get(index, StalenessWeights())
        params = self._params[index]
        accumulator = self._accumulator
        engine = self._engines[index]
        steps = 0
        for k, result in enumerate(results):
            capped = accumulator.capped(index)
            # An asynchronous round larger than a global batch counts as one (its mean gradient: what the
            # trigger made); the synchronous rounds (the finish, AdaptiveBatchSize's split, the switch holding
            # what each rank had pending) count all their samples.
            due = accumulator.add(index, result.tensors, divisor=result.stats.divisor,
                                  samples=int(result.stats.contributions), limit=not result.stats.synchronous)
            if accumulator.capped(index) > capped:
                self._warn_large_round(int(result.stats.contributions), accumulator.reference_samples)
            # The step's first round (the rounds come in order, each once): in the synchronous finish,
            # from its second round on, every micro-batch was computed after every earlier result was applied.
            first_round = result.stats.round_index - accumulator.pending(index) + 1
            result.release()
            self._record(index, result.stats)
            if not due and not (final and k == len(results) - 1):
                continue
            if accumulator.samples(index) == 0:
                continue  # empty rounds (a final round that found nothing pending): no step on a zero gradient
            # A step's gradient sums rounds applied one round after the micro-batches they sum were
            # computed: one optimizer step late, but for the first step of an optimizer without state
            # (no step came between those micro-batches and this one), which is fresh, and for the
            # steps of the synchronous finish (the same rounds on every rank).
            staleness = 1 if not engine.is_fresh(first_round) and any(optimizer.state.get(p) for p in params) else 0
            weight = compensation.gradient_weight(optimizer, weights, staleness)
            # A parameter no micro-batch of this step used, on any rank (find_unused_parameters), keeps no grad.
            self._set_gradients(params, accumulator.take(index))
            if weight != 1.0:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(weight)
            _compat.before_optimizer_step(self.precision_plugin, module, optimizer)
            prediction = self._prediction_in_force()
            before = prediction.begin(index, params) if prediction is not None else None
            optimizer.step()
            steps += 1
            if not final:
                # Counted at once: the next step's hooks (on_before_optimizer_step, clipping, a warm-up keyed
                # by trainer.global_step) see the steps this batch took before it, the same on every rank
                # whatever batches the rounds fell into. The final round's steps are not counted.
                _compat.add_optimizer_steps(self._trainer, 1)
            self.step_lags.stepped(index, result.stats.round_index, accumulator.steps(index))
            # From the gradients as clipped (weight * g after clipping): the same direction and scale.
            compensation.compensate_step(optimizer, weights, params, staleness)
            if prediction is not None and before is not None:
                prediction.finish(index, params, before)  # the step's update, spike included
            if not final:
                # Per optimizer step, not per batch: every rank then steps its schedulers at the same rounds.
                _compat.step_round_schedulers(self._trainer, optimizer, accumulator.steps(index) - 1)
                self._queue_step_saves(self._trainer.global_step, result.stats.round_index)  # the step it reached
        return steps

    def _warn_large_round(self, samples: int, reference: Optional[int]) -> None:
        """Once per fit, rank 0: an asynchronous round held more than ``reference_samples`` (what the trigger
        made), counted as that many."""
        if self._warned_capped:
            return
        self._warned_capped = True
        if self.global_rank == 0:
            log.warning(
                "abs_sgd: a round held %d samples, more than reference_samples (%s), with trigger=%r, "
                "target_samples=%r, interval=%r: it counts as %s samples, a step on its mean gradient, not %.3g "
                "times it (its micro-batches were computed at the same weights, at most one update apart; a "
                "longer step along one gradient diverges). Such rounds train fewer steps per sample: make rounds "
                "hold at most reference_samples (a shorter interval, a smaller target_samples)", samples,
                reference, self.trigger, self.target_samples, self.interval, reference,
                samples / float(reference or 1),
            )

    # ------------------------------------------------------------- agreement
    def _quiesce(self) -> dict[int, int]:
        """Every rank, main thread, collective group: no round in flight afterwards; returns the last round per engine.

        Each engine stops activating rounds; a barrier makes that hold on every
        rank; the last activated round is agreed (one MAX allreduce, which also agrees on the
        last round any rank was handed: ``_handed_rounds``) and waited for.
        """
        for engine in self._engines.values():
            engine.pause()
        self.barrier("abs_sgd quiesce")
        indices = sorted(self._engines)
        known = torch.tensor([self._engines[i].known_round() for i in indices]
                             + [self._engines[i].handed_round() for i in indices], dtype=torch.int64)
        if self.world_size > 1:
            # On the host, on the collective group: never a default-group NCCL collective (partial.py).
            with self._naming_failure("abs_sgd's quiesce (agreeing on the round in flight)"):
                dist.all_reduce(known, op=dist.ReduceOp.MAX, group=self.collective_group)
        rounds = known.cpu().tolist()
        last = {i: int(r) for i, r in zip(indices, rounds)}
        self._handed_rounds = {i: int(r) for i, r in zip(indices, rounds[len(indices):])}
        for i in indices:
            self._engines[i].drain(last[i])
        return last

    @override
    def _begin_without_state(self, engine: DelayedAllreduce, trainer: "pl.Trainer") -> None:
        """A fit resumed without engine state (``drop_engine_state``'s copy, a DDP checkpoint) at epoch ``e``:
        the epochs before it trained ``e`` epochs of global samples, from which the engine counts the epochs and
        the finish (from 0, the resumed epoch ran until twice an epoch's samples). Exact from an epoch-end
        checkpoint; from one saved within an epoch, that epoch's samples trained before the save are trained
        again. The rounds start at 0: ``max_steps``, which counts rounds here, counts afresh."""
        super()._begin_without_state(engine, trainer)
        if trainer.current_epoch > 0 and self._epoch_samples:
            engine.begin_with_samples(trainer.current_epoch * self._epoch_samples)

    @override
    def _final_round(self, index: int, engine: DelayedAllreduce) -> RoundStats:
        """Agreed last round, the final synchronous round, and every result not yet applied."""
        last = self._last_rounds[index]
        results = engine.finish(last)
        optimizer = self.optimizers[index]
        # Rounds that another rank was handed in a batch (where a should_stop ended the fit at an epoch end,
        # EarlyStopping, some ranks applied rounds past it in their last batch): applied here as there, counted
        # and with the schedulers stepped, that every rank ends at the same step and learning rate. The rest
        # (the rounds no rank was handed, the final flush) as before: after the loop, counted on no rank.
        handed = self._handed_rounds.get(index, -1)
        in_batches = [r for r in results[:-1] if r.stats.round_index <= handed]
        if in_batches:
            self._apply(index, optimizer, in_batches)
            self._pending_saves.clear()  # their step saves: after the last batch's boundary, taken on no rank
        self._apply(index, optimizer, results[len(in_batches):], final=True)
        optimizer.zero_grad()
        return results[-1].stats

    @override
    def _finish_at(self, stats: RoundStats) -> None:
        """Nothing here: the engine made that round the final one, and the next batch start ends the fit
        on every rank (``on_train_batch_start``), as at ``max_steps``: each rank applies a round in its own
        batch, so ``should_stop`` set now would end the ranks at different rounds."""

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.step_lags.reset()
        self._warned_capped = False
        self.micro_batches_per_round, self._held, self._arrive_now = 1, {}, None
        self.round_seconds, self.round_fill, self.batch_collectives = None, None, False
        self._end_boundary = None
        trainer = self._trainer
        if self._engines:
            _compat.step_schedulers_by_rounds(trainer)
        for trigger in self._step_checkpoints:
            trigger.queued = trainer.global_step // trigger.every  # a resumed fit: the multiples before it are saved

    def _queue_step_saves(self, global_step: int, round_index: int) -> None:
        """Every rank, main thread, after an optimizer step that brought ``global_step`` to this value: one save
        per multiple of ``n`` passed, queued behind the saves of earlier rounds.

        ``ModelCheckpoint(every_n_train_steps=n)`` saves when ``global_step % n == 0`` at a
        batch end. Under abs_sgd a batch may apply two rounds, so a rank can step over a
        multiple that another rank stops at, and a save (collective: its quiesce and the
        engines' gather) would wait for ranks that never come. Here each rank queues a save
        for every multiple as the round that reaches it is applied, beside the time-based
        saves the rounds announce (``PartialStrategy._record``), and runs the queue at its
        next batch start (or the end of fit): the same saves, in the rounds' order, on every
        rank, however the rounds fell into its batches; each quiesces the engines
        (``save_checkpoint``), so the file is a consistent cut whatever step each rank had reached.
        """
        for trigger in self._step_checkpoints:
            while trigger.queued < global_step // trigger.every:
                trigger.queued += 1
                self._pending_saves.append(
                    (round_index, lambda callback=trigger.callback: _compat.save_step_checkpoint(callback, self._trainer)))

    @override
    def on_train_end(self) -> None:
        """Every rank alike, stopped or not: the saves every rank has reached, the quiesce, then, where a round
        that carried a stop has completed, the results up to it (the stop path for every rank), else the final
        round (``PartialStrategy.on_train_end``).

        A rank applies the stop round in a batch of its own and stops at its next batch start
        (``_stop_now``); a ``should_stop`` at an epoch end (``EarlyStopping``) can end the fit before that
        batch start comes on some ranks, or with the stop round still in flight on all of them. Branching on
        each rank's own ``_stopped`` here paired one rank's quiesce with another's stop-path collectives.
        """
        if self._engines:
            # Before the quiesce, the saves of the rounds every rank has applied: those before the last batch's
            # boundary (the fit's last round; or the epoch's, where a should_stop ended the fit there, and a
            # rank may have applied that round and another not). Later ones are taken on no rank.
            self._run_pending_saves(before=self._end_boundary)
            self._pending_saves.clear()
            self._last_rounds = self._quiesce()
            for index, engine in self._engines.items():
                through_stop = engine.results_through_stop()
                if through_stop:  # the same rounds' results on every rank that had not applied them yet
                    self._apply(index, self.optimizers[index], through_stop)
            self._pending_saves.clear()  # queued by those rounds: after the boundary, taken on no rank
        _compat.restore_scheduler_stepping(self._trainer)
        super().on_train_end()

    @override
    def _release_fit(self) -> None:
        for cb in self._checkpoints:
            _compat.restore_checkpoint_triggers(cb)  # the user's callback as it came
        self._checkpoints = []
        trainer = self._attached_trainer
        if trainer is not None:
            trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, _EpochEndSaves)]
        if self._user_sampler is not None:  # the user's sampler leaves this fit at the size it came with
            sampler, size = self._user_sampler
            sampler.batch_size = size
            self._user_sampler = None
        super()._release_fit()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Quiesces the engines (nothing in flight), gathers their state, then lets them go on.

        (The base class adds the rounds accumulated since the last step and, with
        ``weight_prediction``, the last update: :meth:`_fit_states`.)
        """
        # After a stop too: a save queued by a round before the stop round runs on every rank, on some
        # before the stop reached them (PartialStrategy._stop_now), and the collectives must pair.
        if self._engines:
            self._quiesce()
            try:
                super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            finally:
                for engine in self._engines.values():
                    engine.resume()
            return
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
