"""ModelAveragingStrategy: local steps, then wait-avoiding group model averages (WAGMA-SGD, DS-Sync).

Contract (threads and collectives): see :mod:`lightning_partial.strategies.partial`
for set-up, SIGTERM, checkpoints and the end of fit. Specific to model averaging:

* Each optimizer step (main thread): the optimizer steps on the local
  gradients (no gradient is exchanged); then the optimizer's parameters go to
  its :class:`~lightning_partial.collectives.GroupAverage` (``arrive``) and are
  replaced by the round's group average (:func:`~lightning_partial.collectives.apply_average`).
  With ``order="average_then_step"`` (the WAGMA reference code's order) the
  parameters are averaged after the closure (forward and backward) and
  before the optimizer applies the gradient, which was computed on the
  pre-average model. The engine's communication thread runs the header
  allreduce (gloo, all ranks) and the group's point-to-point exchange on the
  engine's data group.
* With ``average_every=H`` (:mod:`~lightning_partial.strategies.local_steps`) only every ``H``-th
  optimizer step joins the round; the steps between are local, with no collective.
* Every ``global_every``-th round, and the final flush at the end of fit, is a
  synchronous global average (allreduce over all ranks): afterwards all
  replicas are identical (with ``order="average_then_step"``, until each
  applies its own gradient in the same step; the final flush comes after the
  last step).
* Optimizer state (momentum buffers, Adam's moments) stays local, as in the
  reference codes. With an Adam-family optimizer each local step is rescaled,
  per coordinate, to the size DDP's Adam would give it on the global batch
  (``adaptive_scaling``, :mod:`lightning_partial.strategies.adaptive_scaling`):
  main thread, right after ``optimizer.step`` (and so, in the default order,
  before the group average), from the rank's own optimizer state; no collective.
* With ``finish="gradients"`` (not the default) the synchronous finish takes
  DDP's step: main thread, collective group (gloo), after the closure and
  before ``optimizer.step``, the gradients' mean over the ranks in every finish
  round and, at its first, the parameters' and the optimizer state's
  (:mod:`lightning_partial.strategies.gradient_finish`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import Unpack, override

import lightning.pytorch as pl
from lightning_partial.collectives import PartialAllreduceConfig, RoundStats
from lightning_partial.collectives.checks import check_int
from lightning_partial.collectives.group_average import (
    AVERAGE_LATE_POLICIES,
    AVERAGE_NORMALIZATIONS,
    STALE_POLICIES,
    GroupAverage,
    apply_average,
)
from lightning_partial.collectives.schedules import Schedule
from lightning_partial.strategies import adaptive_scaling as scaling_rule
from lightning_partial.strategies import gradient_finish as finish_rule
from lightning_partial.strategies.adaptive_scaling import GlobalBatchScaling
from lightning_partial.strategies.fit_state import FitState
from lightning_partial.strategies.gradient_finish import GradientFinish
from lightning_partial.strategies.local_steps import LocalSteps
from lightning_partial.strategies.options import ScheduleSource, StrategyOptions
from lightning_partial.strategies.partial import ConfiguredStrategy, StepModel

log = logging.getLogger(__name__)

ORDERS: tuple[str, ...] = ("step_then_average", "average_then_step")


class ModelAveragingStrategy(ConfiguredStrategy[GroupAverage]):
    """Base of :class:`WAGMAStrategy` and :class:`DSSyncStrategy`; subclasses build the default schedule.

    Args:
        mode: what activates a round: ``"solo"`` (wait-avoiding: the first rank to
            arrive activates the round for every group; a late member contributes
            its model as of its last arrival), ``"majority"``, ``"quorum"`` or
            ``"sync"`` (every rank arrives before each group exchange).
        quorum, backup_workers: for ``mode="quorum"``, one of the two: a round activates once
            ``quorum`` ranks have arrived, or all but ``backup_workers`` of them (resolved with the
            world size, so one configuration serves any ``P``; eager-SGD's backup workers). A
            quorum round's average holds at least that many models of the round itself; with one
            group of every rank and ``average_every`` > 1 that is what kept the SGD main job's
            accuracy (docs/staleness.md, what activates the rounds of local steps).
        normalize: ``"group"`` (sum / S) or ``"reference"`` ((sum + own model) / (S + 1)),
            see :func:`~lightning_partial.collectives.apply_average`.
        late: ``"damp"`` (default: a late rank keeps the local progress that
            missed the round; while a member is ``k`` rounds late its group moves
            ``1 / (k + 1)`` of the way to the group average; the sum of the replicas
            is conserved; stable for every lag), ``"carry"`` (the same, undamped:
            unstable from a lag of 3) or ``"drop"``, see
            :func:`~lightning_partial.collectives.apply_average`.
        stale: ``"skip"`` (a model enters at most one group average; a rank with
            nothing new sits the round out) or ``"resend"`` (the reference codes: a
            late rank's last model is averaged again in every round until it arrives),
            see :class:`~lightning_partial.collectives.GroupAverage`.
        global_every: every ``global_every``-th round is a synchronous global
            average (``None``: only the final one): ``global_every - 1`` group
            rounds, then a global one.
        average_every: a round every ``average_every``-th optimizer step (``1``, the default: every
            step, the papers'); the steps between are local, on the rank's own gradients, with no
            collective (local SGD with wait-avoiding averages: a rank's communication per sample falls
            by this factor). The synchronous finish keeps the period (its rounds are synchronous global
            averages); ``finish="gradients"`` needs ``average_every=1``.
            ``max_staleness``, ``global_every``, ``measure_every`` and the schedules count rounds
            (:mod:`~lightning_partial.strategies.local_steps`).
        order: ``"step_then_average"`` (default: the local step, then the average
            of the stepped model) or ``"average_then_step"`` (the WAGMA reference
            code: the average of the pre-step model, then the local gradient; the
            average runs in the optimizer's closure, so an optimizer that calls
            its closure more than once per step, such as LBFGS, needs the default).
        max_staleness: no rank runs more than this many rounds ahead of the slowest.
        measure_every: measure the consensus distance every ``n`` rounds (besides
            every global round); logged by :class:`~lightning_partial.callbacks.GroupRotation`.
        adaptive_scaling: ``"auto"`` (default): with an Adam-family optimizer (Adam,
            AdamW, NAdam, RAdam) on more than one rank, ``"global_batch"``; otherwise
            ``"none"``. ``"global_batch"``: each local step is rescaled per coordinate
            to what Adam's normalisation would give on the global batch (a gradient of
            ``1/P`` of the batch has ``P`` times its noise variance, which shrinks an
            averaged Adam step by up to ``sqrt(P)`` against DDP's; see
            :mod:`~lightning_partial.strategies.adaptive_scaling`); refused at set-up for
            other optimizers. ``"none"``: the reference codes' local steps. SGD needs no
            scaling: its averaged local steps are DDP's.
        final_sync: the fraction of the fit's optimizer steps, at its end, whose rounds are
            synchronous global averages (every rank's model of this very step), as
            ``EagerSGDStrategy``'s (:mod:`~lightning_partial.strategies.final_sync`; by steps, or
            by ``max_time`` where the time limit comes first).
            ``0.05`` (default; measured in ``docs/staleness.md#the-synchronous-finish``);
            ``0.0``: every round as ``mode`` and ``global_every`` say (the reference codes').
        finish: what a finish round averages. ``"models"`` (default): the global average of
            the local steps (for SGD, with or without momentum, DDP's step). ``"gradients"``:
            DDP's step for Adam too: the parameters and the optimizer state are averaged over
            the ranks at the finish's first round (Adam's second moment with adaptive scaling's noise
            correction where scaling is in force), and every finish round steps on the
            gradients' mean (:mod:`~lightning_partial.strategies.gradient_finish`; SGD and the
            Adam family, refused at set-up for other optimizers). Not the default: under AdamW
            it measured no better (``docs/staleness.md#ddps-step-in-the-finish``).
        seed: seed of the majority initiator RNG and of the shuffle schedule.
        schedule: a :class:`~lightning_partial.collectives.schedules.Schedule`, or a
            callable ``world_size -> Schedule``; default: the subclass's.
        timeout, collective_timeout, process_group_backend, start_method: see :class:`PartialStrategy`.
    """

    strategy_name = "model_averaging"
    engine_family = "models"

    def __init__(
        self,
        *,
        mode: str = "solo",
        quorum: Optional[int] = None,
        backup_workers: Optional[int] = None,
        normalize: str = "group",
        late: str = "damp",
        stale: str = "skip",
        global_every: Optional[int] = None,
        average_every: int = 1,
        order: str = "step_then_average",
        max_staleness: Optional[int] = None,
        measure_every: Optional[int] = None,
        adaptive_scaling: str = "auto",
        final_sync: float = 0.05,
        finish: str = "models",
        seed: int = 0,
        schedule: Optional[ScheduleSource] = None,
        **kwargs: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**kwargs)
        self._set_final_sync(final_sync)
        self.adaptive_scaling = scaling_rule.check_scaling(adaptive_scaling, owner=self.strategy_name)
        self.finish = finish_rule.check_finish(finish, owner=self.strategy_name)
        if normalize not in AVERAGE_NORMALIZATIONS:
            raise ValueError(f"unknown normalize {normalize!r}: expected one of {', '.join(AVERAGE_NORMALIZATIONS)}")
        if late not in AVERAGE_LATE_POLICIES:
            raise ValueError(f"unknown late policy {late!r}: expected one of {', '.join(AVERAGE_LATE_POLICIES)}")
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}: expected one of {', '.join(ORDERS)}")
        if stale not in STALE_POLICIES:
            raise ValueError(f"unknown stale policy {stale!r}: expected one of {', '.join(STALE_POLICIES)}")
        check_int("global_every (tau)", global_every, optional=True)
        check_int("average_every", average_every, owner=self.strategy_name)
        self.average_every = int(average_every)
        if self.average_every > 1 and self.finish == "gradients" and self.final_sync > 0:
            raise ValueError(
                f"{self.strategy_name}: finish='gradients' takes DDP's step at every step of the finish, which "
                f"needs a round every step; with average_every={average_every} the finish keeps the period "
                "(synchronous global averages): use finish='models' (the default)"
            )
        check_int("measure_every", measure_every, optional=True)
        if schedule is not None and not (isinstance(schedule, Schedule) or callable(schedule)):
            raise ValueError(f"schedule must be a Schedule or a callable world_size -> Schedule, got {schedule!r}")
        self.partial_config = PartialAllreduceConfig(
            mode=mode,  # type: ignore[arg-type]
            quorum=quorum,
            backup_workers=backup_workers,
            normalize="sum",
            late="carry",
            sync_every=global_every,
            max_staleness=max_staleness,
            seed=seed,
            timeout=self._timeout,
            collective_timeout=self._collective_timeout,
            name=self.strategy_name,
        )
        self.normalize = normalize
        self.late = late
        self.stale = stale
        self.global_every = global_every
        self.order = order
        self.measure_every = measure_every
        self.seed = seed
        self._schedule_source = schedule
        self.schedule: Optional[Schedule] = None  # built for the world size at set-up
        # Resolved against the optimizers at set-up: the indices whose local steps are rescaled.
        self._scaled: set[int] = set()
        self._scaling: Optional[GlobalBatchScaling] = None
        # Likewise the indices whose finish rounds take DDP's step (finish="gradients").
        self._ddp_finish: set[int] = set()
        self._gradient_finish: Optional[GradientFinish] = None
        self._local_steps = LocalSteps(self.average_every)

    # ------------------------------------------------------------ schedule
    def default_schedule(self, world_size: int) -> Schedule:
        """The schedule used when none is given (raises ``ValueError`` if ``world_size`` does not suit it)."""
        raise NotImplementedError

    def set_schedule(self, schedule: ScheduleSource) -> None:
        """Replaces the schedule; only before the engines start (e.g. from a callback's ``setup``)."""
        if self._engines:
            raise RuntimeError(
                "the schedule cannot change while the engines run: communication threads may already be "
                "rounds ahead; give GroupRotation a switch_at instead"
            )
        self._schedule_source = schedule
        self.schedule = None

    def build_schedule(self, world_size: int) -> Schedule:
        """The schedule for ``world_size`` ranks; raises ``ValueError`` with the reason if it cannot be built."""
        source = self._schedule_source
        if source is None:
            schedule = self.default_schedule(world_size)
        elif isinstance(source, Schedule):
            schedule = source
        else:
            schedule = source(world_size)
        schedule.check_world(world_size)
        return schedule

    @override
    def validate_world(self, world_size: int) -> None:
        super().validate_world(world_size)
        self.schedule = self.build_schedule(world_size)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        # After the optimizers exist, before any rank trains: an optimizer the rule cannot read fails here.
        self._scaled = scaling_rule.resolve_all(
            self.adaptive_scaling, self.optimizers, world_size=self.world_size, owner=self.strategy_name
        )
        self._scaling = GlobalBatchScaling(self.world_size) if self._scaled else None
        self._ddp_finish = finish_rule.resolve_all(
            self.finish, self.optimizers, world_size=self.world_size, owner=self.strategy_name
        ) if self.final_sync > 0 else set()
        self._gradient_finish = GradientFinish(
            group=self.collective_group, rank=self.global_rank, world_size=self.world_size,
            arrival_timeout=self._timeout, timeout=self._collective_timeout,
        ) if self._ddp_finish else None

    @override
    def update_rule(self) -> dict[str, Any]:
        """:meth:`PartialStrategy.update_rule`, and ``adaptive_scaling`` and ``finish`` resolved per optimizer,
        comma-separated (``finish``: ``"gradients"`` only where the finish runs and the option applies)."""
        settings = super().update_rule()
        indices = range(max(len(self.optimizers), 1))
        settings["adaptive_scaling"] = ",".join("global_batch" if i in self._scaled else "none" for i in indices)
        settings["finish"] = ",".join("gradients" if i in self._ddp_finish else "models" for i in indices)
        settings["average_every"] = self.average_every
        return settings

    # ---------------------------------------------------------- local steps
    @override
    def _fit_states(self) -> list[FitState]:
        states = super()._fit_states()
        return [*states, self._local_steps] if self.average_every > 1 else states

    @override
    def _start_engines(self, trainer: "pl.Trainer") -> None:
        # Before the engines are built: where each optimizer resumes in its period places the finish's round.
        self._local_steps.begin()
        super()._start_engines(trainer)

    @property
    @override
    def _steps_per_round(self) -> int:
        return self.average_every

    @override
    def _rounds_in(self, index: int, steps: int) -> int:
        return self._local_steps.rounds_in(index, steps)

    @override
    def _release_fit(self) -> None:
        self._scaling = None  # its copy of the weights is not needed after the fit
        self._gradient_finish = None  # holds the collective group
        super()._release_fit()

    def __getstate__(self) -> dict[str, Any]:
        # The finish's collectives hold the collective group, which cannot be pickled; set-up makes them again.
        state = super().__getstate__()
        state["_gradient_finish"] = None
        return state

    # ------------------------------------------------------------- engines
    @override
    def _build_engine(self, index: int, params: list[torch.nn.Parameter], store: dist.Store) -> GroupAverage:
        if self.schedule is None:
            self.schedule = self.build_schedule(self.world_size)
        return GroupAverage(
            self._round_config(index, name=f"{self.strategy_name}-{index}"),
            schedule=self.schedule,
            store=store,
            rank=self.global_rank,
            world_size=self.world_size,
            like=[p.detach() for p in params],
            measure_every=self.measure_every,
            stale=self.stale,  # type: ignore[arg-type]
        )

    @override
    def _engine_step(self, index: int, optimizer: Optimizer, closure: Callable[[], Any], model: StepModel,
                     kwargs: dict[str, Any]) -> Any:
        """The local step on local gradients and this round's group average of the parameters, in ``order``
        (only the local step where ``average_every`` makes this step a local one).

        With ``adaptive_scaling`` in force for this optimizer, the weights are noted
        once the closure has run (and, in ``average_then_step``, averaged): right
        before ``optimizer.step``, so that the rescaling sees the optimizer's step alone.
        In a finish round with ``finish="gradients"`` in force, the gradients are averaged
        there instead (and, at the finish's first round, the parameters and the optimizer
        state), and nothing is rescaled (:mod:`~lightning_partial.strategies.gradient_finish`).
        """
        params = self._params[index]
        raw = self.optimizers[index]
        # Every rank decides alike: the same count of local steps since the engine's last round.
        averaging = self._local_steps.joins_round(index)
        average_first = averaging and self.order == "average_then_step"
        engine = self._engines[index]
        round_index = engine.step
        sync_from = engine.sync_from  # configured, or requested by a time limit (known from its round on)
        gradients = (self._gradient_finish if index in self._ddp_finish and sync_from is not None
                     and round_index >= sync_from else None)  # (a round every step: average_every=1)
        # DDP's step in the finish: the gradient is the global batch's, nothing to rescale.
        scaling = self._scaling if index in self._scaled and gradients is None else None

        def closure_then_prepare() -> Any:
            # The gradients exist (computed on the pre-average model); the optimizer
            # applies them to the average once this returns.
            result = closure()
            if average_first:
                self._average(index)
            if gradients is not None:
                gradients.mean_gradients(params, round_index=round_index)
                if round_index == sync_from:
                    # One model (the engine's average already made it in average_then_step) and one
                    # optimizer state before the first of DDP's steps.
                    if not average_first:
                        gradients.mean_parameters(params, round_index=round_index)
                    gradients.average_state(raw, params, noise_correction=index in self._scaled,
                                            round_index=round_index)
            if scaling is not None:
                scaling.begin(index, raw, params)
            return result

        needs_wrap = average_first or scaling is not None or gradients is not None
        output = self._lightning_step(optimizer, closure_then_prepare if needs_wrap else closure, model, kwargs)
        if scaling is not None:
            scaling.finish(index, raw, params)
        if averaging and not average_first:
            self._average(index)
        self._local_steps.stepped(index, averaged=averaging)
        return output

    def _average(self, index: int) -> None:
        params = [p.detach() for p in self._params[index]]
        result = self._engines[index].arrive(params)
        apply_average(result, params, normalize=self.normalize, late=self.late)  # type: ignore[arg-type]
        result.release()
        self._record(index, result.stats)

    @override
    def _end_after_stop(self) -> None:
        """The stop replaced the final global average. Every rank is here (the stop rode in the last step's
        round), so the parameters are averaged over the collective group instead: the replicas end identical,
        as after the final average (a stop that raises ``SIGTERMException`` ends the fit before this)."""
        self._mean_over_ranks([p.detach() for params in self._params.values() for p in params],
                              "the final parameters")

    @override
    def _final_round(self, index: int, engine: GroupAverage) -> RoundStats:
        """The final global average of the parameters: every replica ends identical."""
        params = [p.detach() for p in self._params[index]]
        result = engine.flush(params)
        apply_average(result, params, normalize=self.normalize, late=self.late)  # type: ignore[arg-type]
        result.release()
        return result.stats
