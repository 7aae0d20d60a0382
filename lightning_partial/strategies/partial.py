"""PartialStrategy: what every lightning_partial strategy shares (Lightning side).

Contract (threads and collectives), common to eager-SGD, WAGMA-SGD and DS-Sync:

* Set-up (every rank, main thread, default group): the process group is
  initialised as in ``DDPStrategy``, plus the strategy's collective group
  (below); rank 0's parameters and buffers are broadcast once. At
  ``on_train_start`` (after Lightning restored a checkpoint): a dedicated
  ``TCPStore`` is created (its address broadcast once); one engine per
  optimizer (built by the subclass) loads its checkpointed state, if any, and
  starts its communication thread.
* Each optimizer step: the subclass hands its tensors to the engine
  (``arrive``). No collective runs on the default group per step: the engine's
  communication thread issues the round's collectives on the engine's groups,
  and Lightning's per-batch SIGTERM broadcast is replaced by a local flag.
* SIGTERM on any rank: the strategy's handler asks the engines to stop; the
  request travels in the next round's header, so every rank learns it in the
  same round ``R``, and every rank raises ``SIGTERMException`` at the start of
  its next batch, with no round after ``R`` left waiting. (In pure ``sync``
  mode, Lightning's own handling is kept.)
* Decisions by the clock (``max_time``, ``ModelCheckpoint(train_time_interval=...)``,
  a time-based ``val_check_interval``): rank 0's clock decides, as under DDP,
  and the decision travels in the next round's header instead of a per-batch
  broadcast, so every rank acts on it at the same round
  (:mod:`~lightning_partial.strategies.agreed_clock`). (Pure ``sync`` mode keeps
  Lightning's own handling.)
* End of fit (main thread): the subclass's final round (``flush()``) on every
  engine, so nothing computed is lost and all replicas end identical; then one
  allreduce per buffer on the collective group (floating-point buffers averaged,
  others taken from rank 0), so that the buffers end identical too.
* Checkpoints (every rank, main thread, collective group): ``save_checkpoint``
  gathers every rank's engine state into rank 0's file with one
  ``gather_object``; a resumed fit gives each rank its own state back.
* Validation, test and predict never touch the engines.

**Invariant: one thread per NCCL communicator while the engines run**: the
strategy's own collectives run on a gloo group, never beside the engines' NCCL
rounds (see :mod:`lightning_partial.strategies.process_group`).
"""

from __future__ import annotations

import contextlib
import logging
from abc import abstractmethod
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable, ClassVar, Generic, Optional, Protocol, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.optim import Optimizer
from typing_extensions import Unpack, override

import lightning.pytorch as pl
from lightning_partial import _compat
from lightning_partial.collectives import PartialAllreduceConfig, PartialCollectiveError, RoundStats, create_store
from lightning_partial.collectives.checks import check_timedelta
from lightning_partial.collectives.errors import PartialCollectiveTimeout, error_kind, naming_failure
from lightning_partial.collectives.liveness import Heartbeat
from lightning_partial.collectives.staleness import StalenessWeights
from lightning_partial.strategies.agreed_clock import AgreedClock
from lightning_partial.strategies.checkpoint import (CHECKPOINT_KEY, LAYOUT_KEY, CheckpointMismatchError,
                                                     gather_engine_states, resume_entry, state_for_rank)
from lightning_partial.strategies.final_sync import check_final_sync, first_sync_round
from lightning_partial.strategies.fit_state import FitState
from lightning_partial.strategies.options import ProcessGroupOptions
from lightning_partial.strategies.prediction import WeightPrediction
from lightning_partial.strategies.process_group import ProcessGroupStrategy
from lightning_partial.strategies.rank_mean import allreduce_sum, mean_in_place

log = logging.getLogger(__name__)


# Seconds between a heartbeat's verdict (a peer is gone) and the end of a process that
# has not torn down by then: collective_timeout + this is the longest a survivor lives on.
_EXIT_GRACE = 20.0


class Engine(Protocol):
    """What :class:`PartialStrategy` asks of an engine: ``PartialAllreduce``, ``GroupAverage``, ``DelayedAllreduce``."""

    @property
    def round_reached(self) -> int: ...

    @property
    def step(self) -> int: ...

    def begin_at(self, round_index: int) -> None: ...

    def start(self) -> Any: ...

    def request_stop(self) -> None: ...

    def request_finish(self) -> None: ...

    def announce(self, flags: int) -> None: ...

    def close(self, timeout: float = 10.0) -> None: ...

    def fail(self, error: PartialCollectiveError) -> None: ...

    def attach_liveness(self, liveness: Any, *, engine: Optional[int] = None) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


EngineT = TypeVar("EngineT", bound=Engine)
#: The ``model`` argument of Lightning's ``optimizer_step``.
StepModel = Optional[Union["pl.LightningModule", torch.nn.Module]]


def _trainable(optimizer: Optimizer) -> list[torch.nn.Parameter]:
    """The optimizer's parameters with ``requires_grad``, in its order: what an engine takes at train start, and
    what each step checks is still the same (:meth:`PartialStrategy._check_trainable`)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


class PartialStrategy(ProcessGroupStrategy, Generic[EngineT]):
    """Base of the strategies over the partial-collective engines; not registered itself.

    Generic over the engine type ``EngineT``. Subclasses set :attr:`strategy_name`
    and implement :meth:`_build_engine`, the per-step hand-off to the engine
    (:meth:`_engine_step`) and :meth:`_final_round`; those whose rounds can be all
    synchronous or whose configuration depends on the world size override
    :attr:`synchronous` and :meth:`validate_world` (:class:`ConfiguredStrategy` does
    both from a ``PartialAllreduceConfig``).

    Args:
        timeout: bound on every wait that includes other ranks' compute (a round's
            activation, a synchronous round, barriers, the checkpoint's gather) and on
            process-group set-up. Keep it above the longest pause of any rank (a
            validation loop, a checkpoint): a slow rank is never failed before it.
        collective_timeout: bound on a round's collectives once it is activated (every
            rank's communication thread then enters them at once, however slow its
            compute) and the silence after which a rank's heartbeat declares the rank
            it watches dead: a frozen or cut-off rank ends the job in about this long,
            with an error naming it. Never more than ``timeout``.
        process_group_backend: default ``"nccl"`` on CUDA, ``"gloo"`` otherwise.
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"`` or ``"fork"``.

    The strategy object holds no thread and no group until ``setup``: it can be
    pickled (the ``*_spawn`` registry names); a forked rank inherits none (``*_fork``).
    """

    strategy_name = "partial"
    #: What the engines exchange: ``"gradients"`` or ``"models"`` (checked on resume).
    engine_family = "gradients"
    #: The fraction of the fit, at its end, run as synchronous rounds
    #: (:mod:`~lightning_partial.strategies.final_sync`); set with :meth:`_set_final_sync`.
    final_sync: float = 0.0
    #: The registry names of a concrete strategy: ``(name, description, constructor keyword
    #: arguments)``; :meth:`register_strategies` adds each with ``start_method="popen"``, a
    #: ``<name>_spawn`` twin with ``start_method="spawn"`` and a ``<name>_fork`` twin with ``"fork"``.
    registry_entries: ClassVar[tuple[tuple[str, str, dict[str, Any]], ...]] = ()
    #: Whether every rank applies round ``r`` in its step ``r`` (the same batch on every rank): then a
    #: time-based validation can run at an agreed step (``abs_sgd``: no; it validates at epoch ends only).
    lockstep: ClassVar[bool] = True
    #: Whether a time limit (``max_time``) starts the synchronous finish once ``1 - final_sync`` of it has
    #: passed (the engines' ``request_sync``); ``abs_sgd`` counts its finish in samples or rounds only.
    finish_by_time: ClassVar[bool] = True

    def __init__(
        self, *, collective_timeout: timedelta = timedelta(seconds=60), **kwargs: Unpack[ProcessGroupOptions]
    ) -> None:
        super().__init__(**kwargs)
        check_timedelta("collective_timeout", collective_timeout)
        self._collective_timeout = collective_timeout
        # Created at on_train_start, never in __init__: the strategy must stay picklable.
        self._engines: dict[int, EngineT] = {}
        self._params: dict[int, list[torch.nn.Parameter]] = {}
        self._store: Optional[dist.Store] = None
        self._heartbeat: Optional[Heartbeat] = None
        self._stopped = False  # a round carried a stop request: every rank stops at it
        # The gradient strategies' option (_set_find_unused_parameters): a presence number per parameter rides
        # with every gradient, so it shapes the engines' saved state (LAYOUT_KEY). Models carry none.
        self.find_unused_parameters = False
        self._stop_round: Optional[int] = None  # that round (the first engine's to carry one)
        self._finishing = False  # a round carried a finish request: every rank ends its fit at it
        self._clock: Optional[AgreedClock] = None  # built per fit at train start
        # Checkpoint saves that applied rounds called for, with the round, in round order (every rank queues
        # the same ones in the same order); run at the next batch start or the end of fit (main thread).
        self._pending_saves: list[tuple[int, Callable[[], None]]] = []
        # At a batch start, run only the saves of rounds before this one (abs_sgd's epoch-last batch).
        self._save_boundary: Optional[int] = None
        # While the queued saves run (main thread): their collectives are the strategy's own, run by every rank
        # at the same round, whichever hook runs them (a subclass's _before_collective lets them pass).
        self._running_saves = False
        self._previous_sigterm_handler: Any = None
        self._stop_check_at_batch_start = False  # Lightning before 2.6: see _check_stop_at_batch_start
        self._resume_state: Optional[dict[str, Any]] = None  # from load_checkpoint, consumed at start
        self._final_states: dict[int, dict[str, Any]] = {}  # engine states after the final flush
        # While the engines are built (_start_engines): the first round of the one being built, and the world
        # size of the checkpoint the fit resumes (its own when none).
        self._first_round = 0
        self._saved_world_size = 0
        # The latest round's statistics per optimizer index (read by StalenessTracker).
        self.round_stats: dict[int, RoundStats] = {}
        # Called with (optimizer index, stats) for every round this rank applies, in order
        # (callbacks that need every round, not only the latest: AdaptiveBatchSize).
        self.round_listeners: list[Callable[[int, RoundStats], None]] = []
        # Per optimizer index, the staleness rule resolved against the optimizers at set-up
        # (eager_sgd, abs_sgd); empty for a strategy that weighs no late gradient.
        self._staleness: dict[int, StalenessWeights] = {}
        # Weight prediction (eager_sgd, abs_sgd: _set_weight_prediction); None: gradients of the current weights.
        self.weight_prediction = False
        self._prediction: Optional[WeightPrediction] = None

    def update_rule(self) -> dict[str, Any]:
        """What this strategy does with late gradients, for loggers (``StalenessTracker`` logs it at train start).

        ``weight_prediction`` (bool), ``final_sync`` (the fraction of the fit run as
        synchronous rounds), and, for a strategy that weighs late gradients,
        ``staleness_rule``: the rule resolved at set-up per optimizer, comma-separated
        (``"auto"`` resolved to ``"inverse"``, ``"momentum"`` or ``"none"``).
        """
        settings: dict[str, Any] = {"weight_prediction": self._prediction_in_force() is not None,
                                    "final_sync": self.final_sync}
        if self._staleness:
            settings["staleness_rule"] = ",".join(self._staleness[i].rule for i in sorted(self._staleness))
        return settings

    def _set_final_sync(self, final_sync: float) -> None:
        """A subclass's ``final_sync`` option (:mod:`~lightning_partial.strategies.final_sync`), validated."""
        self.final_sync = check_final_sync(final_sync, owner=self.strategy_name)

    def _fit_states(self) -> list[FitState]:
        """The state this strategy carries from step to step beside the engines' (main thread only).

        Each is saved in checkpoints, kept from a checkpoint loaded to fit (and
        forgotten from one loaded to validate, test or predict) and reset at train
        start: weight prediction's last update here; a subclass adds its own.
        """
        prediction = self._prediction_in_force()
        return [prediction] if prediction is not None else []

    def _prediction_in_force(self) -> Optional[WeightPrediction]:
        """The weight prediction this fit uses: ``None`` with ``weight_prediction=False``, or where a subclass
        knows that no gradient is late (then its steps are those without prediction). Read once the
        world size is known (set-up, checkpoint loading, training)."""
        return self._prediction

    def _set_find_unused_parameters(self, enabled: object) -> None:
        """A gradient strategy's ``find_unused_parameters`` option, validated at construction."""
        if not isinstance(enabled, bool):
            raise ValueError(f"{self.strategy_name}: find_unused_parameters must be a bool, got {enabled!r}")
        self.find_unused_parameters = enabled

    def _set_weight_prediction(self, enabled: object) -> None:
        """A subclass's ``weight_prediction`` option, validated at construction."""
        if not isinstance(enabled, bool):
            raise ValueError(f"{self.strategy_name}: weight_prediction must be a bool, got {enabled!r}")
        self.weight_prediction = enabled
        self._prediction = WeightPrediction() if enabled else None

    # --------------------------------------------------------------- set-up
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.check_precision()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        if fitting:
            self._refuse_sync_batchnorm(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # Identical initial weights: one broadcast from rank 0 at set-up, never per step.
        _compat._sync_module_states(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _compat._optimizers_to_device(self.optimizers, self.root_device)
            # Fails here, before any process is busy training, if P does not suit the configuration.
            self.validate_world(self.world_size)

    def _refuse_sync_batchnorm(self, model: torch.nn.Module) -> None:
        """Raises ``ValueError`` if ``model`` has ``SyncBatchNorm`` layers and rounds are not all synchronous.

        A ``SyncBatchNorm`` forward is a collective on the default group: it would make
        every step wait for every rank (what the strategy exists to avoid) and, on
        GPUs, run NCCL kernels of the default group beside the engines' rounds.
        """
        if self.synchronous:
            return
        names = [name for name, m in model.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
        if names:
            raise ValueError(
                f"{type(self).__name__} does not support SyncBatchNorm (layers {names[:3]}"
                f"{' ...' if len(names) > 3 else ''}): each forward would synchronise all ranks on the default "
                "group. Use BatchNorm (each replica keeps its own statistics; the strategy averages the buffers "
                "at the end of fit) or GroupNorm, and do not pass sync_batchnorm=True"
            )

    @property
    def synchronous(self) -> bool:
        """Whether every round waits for every rank (``mode="sync"``); ``False`` unless a subclass says so.

        Synchronous rounds keep Lightning's own SIGTERM handling and allow ``SyncBatchNorm``
        (see :mod:`lightning_partial.strategies.process_group`).
        """
        return False

    def validate_world(self, world_size: int) -> None:
        """Checks what depends on the number of ranks; raises ``ValueError`` (nothing here)."""

    @property
    def _trainer(self) -> "pl.Trainer":
        """The trainer fitting the module (set up: there is one)."""
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @property
    def _attached_trainer(self) -> Optional["pl.Trainer"]:
        """The module's trainer; ``None`` without a module or where the module is attached to none."""
        return getattr(self.lightning_module, "_trainer", None)

    def check_precision(self) -> None:
        """Refuses a gradient scaler (``precision="16-mixed"``) with a clear error."""
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            # The GradScaler skips a step on a rank whose *local* gradients overflow:
            # with partial averaging ranks would then apply different updates.
            raise ValueError(
                f"{type(self).__name__} does not support precision='16-mixed' (its gradient scaler decides per rank "
                "whether to skip a step, which would make the replicas diverge): use '32-true', 'bf16-mixed' "
                "or 'bf16-true'"
            )

    @abstractmethod
    def _build_engine(self, index: int, params: list[torch.nn.Parameter], store: dist.Store) -> EngineT:
        """The engine of optimizer ``index`` over ``params`` (not started)."""

    def _start_engines(self, trainer: "pl.Trainer") -> None:
        """Collective (every rank, main thread): the store, one engine per optimizer, their threads.

        Runs at ``on_train_start``, after Lightning restored a checkpoint's
        training state, because an engine's state must be loaded before it starts.
        """
        self.round_stats.clear()  # this fit's rounds only (what a failed collective names, what callbacks read)
        # Nothing of an earlier fit on this trainer: its stop (Lightning resets its own flag every run), and its
        # final engine states (a checkpoint after this fit has this fit's).
        self._stopped, self._stop_round = False, None
        self._final_states = {}
        self._store = create_store(timeout=self._timeout, group=self.collective_group)
        resume = self._resume_state
        self._resume_state = None
        self._saved_world_size = int(resume.get("world_size", self.world_size)) if resume else self.world_size
        for index, optimizer in enumerate(self.optimizers):
            params = _trainable(optimizer)
            if not params:
                continue
            state = self._engine_state(resume["engines"][index]) if resume and index in resume["engines"] else None
            # The engine's first round (read by _round_config while the engine is built): a checkpoint's, or,
            # resumed without engine state (drop_engine_state, a DDP checkpoint), where the steps say.
            self._first_round = int(state["step"]) if state is not None else self._first_round_without_state(trainer)
            engine = self._build_engine(index, params, self._store)
            if state is not None:
                engine.load_state_dict(state)
            else:
                self._begin_without_state(engine, trainer)
            engine.start()
            self._engines[index] = engine
            self._params[index] = params
        self._start_heartbeat()
        self._finishing = False
        self._pending_saves, self._save_boundary = [], None
        if not self.synchronous:
            # A globally synchronous step costs the broadcast nothing extra: keep
            # Lightning's own SIGTERM handling and clock decisions in pure sync mode.
            # Lightning before 2.6 has no per-batch broadcast to replace: the check then runs at this
            # strategy's batch start (on_train_batch_start), on every rank at the same batch as well.
            self._stop_check_at_batch_start = not _compat.replace_sigterm_broadcast(trainer, self._stop_now)
            if self._engines:
                self._clock = AgreedClock(
                    rank=self.global_rank, finish=self._request_finish, announce=self._announce,
                    lockstep=self.lockstep, begin_finish=self._request_sync if self.finish_by_time else None,
                    final_sync=self.final_sync, finish_at_step=self._finish_at_step(trainer),
                )
                self._clock.take_over(trainer)

    def _start_heartbeat(self) -> None:
        """This rank's liveness monitor: a peer silent for ``collective_timeout`` fails every engine.

        If the process has not torn down within ``_EXIT_GRACE`` seconds of the verdict
        (its main thread blocked in a collective with the dead rank, which gloo cannot
        cancel), the heartbeat ends it with exit code 1, so that no rank hangs.
        """
        if not self._engines or self.world_size < 2 or self._store is None:
            return
        engines = list(self._engines.values())

        def on_dead(error: PartialCollectiveError) -> None:
            for engine in engines:
                engine.fail(error)

        self._heartbeat = Heartbeat(
            self._store,
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=min(self._collective_timeout, self._timeout),  # as the engines bound a round's collectives
            on_dead=on_dead,
            progress=lambda: max(e.round_reached for e in engines),
            exit_grace=_EXIT_GRACE,
            name=f"{self.strategy_name}-heartbeat",
            # One engine's rounds: a timed-out round may name the ranks behind by the progress. Several
            # optimizers may step at different rates (the progress is the largest round of any): each engine's
            # round rides in the beats too, and a timed-out round compares its own engine's.
            rounds_comparable=len(engines) == 1,
            engine_rounds=(lambda: [e.round_reached for e in engines]) if len(engines) > 1 else None,
        ).start()
        for index, engine in enumerate(engines):
            engine.attach_liveness(self._heartbeat, engine=index if len(engines) > 1 else None)

    def _first_round_without_state(self, trainer: "pl.Trainer") -> int:
        """The first round of an engine that starts without a checkpoint's state: 0 (a subclass whose rounds
        follow the optimizer steps starts a resumed fit's at its step)."""
        return 0

    def _begin_without_state(self, engine: EngineT, trainer: "pl.Trainer") -> None:
        """Before ``start()``, an engine without a checkpoint's state (a fresh fit, or one resumed from
        ``drop_engine_state``'s copy or a DDP checkpoint): its first round, where the steps say."""
        if self._first_round > 0:
            engine.begin_at(self._first_round)

    def _engine_state(self, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's engine state from a checkpoint's per-rank states."""
        return state_for_rank(per_rank, rank=self.global_rank, world_size=self.world_size)

    @override
    def on_train_start(self) -> None:
        self._start_engines(self._trainer)
        for state in self._fit_states():
            # Never a previous fit's state (or another model's); a resumed checkpoint's, if it has one.
            state.reset(self._params)
        # Lightning registers its SIGTERM handler after strategy.setup(); replace it
        # here. Its handler broadcasts from rank 0 inside the handler and marks the
        # rank as stopping at the end of the batch, alone: a rank that stops alone
        # leaves the others waiting in rounds that need its communication thread.
        if self._engines and not self.synchronous:
            self._previous_sigterm_handler = _compat.install_sigterm_handler(self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM: ask every rank to stop at the same round (via the engines' round header)."""
        log.info("rank %d: received SIGTERM; every rank stops at the next round", self.global_rank)
        for engine in self._engines.values():
            engine.request_stop()

    def _request_finish(self) -> None:
        """Rank 0, main thread, at a batch end whose Timer is up: every engine asks every rank to finish."""
        log.info("rank %d: the training time limit is up; every rank ends its fit at the next round",
                 self.global_rank)
        for engine in self._engines.values():
            engine.request_finish()

    def _finish_at_step(self, trainer: "pl.Trainer") -> Optional[int]:
        """The global step at which rank 0 asks for the synchronous finish, where the engines cannot place it:
        several optimizers under manual optimization with ``max_steps`` (which counts every optimizer's steps,
        so no engine knows in advance which of its rounds are the fit's last); else ``None``.

        The last ``final_sync`` of ``max_steps``, moved earlier by the request's margin (``max_staleness + 2``
        rounds of :attr:`_steps_per_round` steps, and the steps until the next round) at one round per optimizer
        and batch, so that an engine stepping every batch has its share
        of the finish; one that steps rarely has fewer rounds in it. Never reached where the epochs end the
        fit first (their finish is placed in the engines' rounds as for one optimizer).
        """
        optimizers = len(self.optimizers)
        if not (self.final_sync and self.finish_by_time and self._engines and optimizers > 1
                and not trainer.lightning_module.automatic_optimization and trainer.max_steps != -1):
            return None
        first = first_sync_round(self.final_sync, trainer.max_steps, owner=self.strategy_name, rank=self.global_rank)
        assert first is not None  # max_steps >= 1, final_sync > 0
        margin = (max(engine.sync_margin for engine in self._engines.values()) + 1) * self._steps_per_round - 1
        return max(0, first - optimizers * margin)

    @property
    def _steps_per_round(self) -> int:
        """An engine's round comes every this many of its optimizer's steps (model averaging's ``average_every``)."""
        return 1

    def _request_sync(self) -> None:
        """Rank 0, main thread, at a batch start once ``1 - final_sync`` of ``max_time`` has passed (or at
        :meth:`_finish_at_step`): every engine asks every rank for the synchronous finish (each engine's rounds
        are synchronous from the same round on every rank, a few rounds on: ``PartialAllreduce.request_sync``)."""
        log.info("rank %d: asking for the synchronous finish (final_sync=%s) at step %d: each engine's rounds are "
                 "synchronous from a few rounds on", self.global_rank, self.final_sync, self._trainer.global_step)
        for engine in self._engines.values():
            engine.request_sync()

    def _announce(self, flags: int) -> None:
        """Rank 0, main thread: clock decisions for every rank, in the next round of the first engine."""
        self._engines[min(self._engines)].announce(flags)

    def _record(self, index: int, stats: RoundStats) -> None:
        self.round_stats[index] = stats
        for listener in self.round_listeners:
            listener(index, stats)
        if stats.stop and not self._stopped:
            self._stopped = True  # the next batch start raises SIGTERMException on every rank
            self._stop_round = stats.round_index
        clock = self._clock
        if clock is not None and stats.announced and self._engines and index == min(self._engines):
            for checkpoint in clock.record(stats.announced):
                self._pending_saves.append((stats.round_index, lambda c=checkpoint: clock.save(self._trainer, c)))
        if stats.finish and not self._finishing:
            self._finishing = True
            self._finish_at(stats)

    def _finish_at(self, stats: RoundStats) -> None:
        """Every rank, main thread, as it applies the first round that carried a finish request.

        Lightning ends the fit after this batch (``should_stop``, as the Timer would set it): every
        rank applies round ``r`` in step ``r``, so every rank ends at the same step. A strategy whose
        ranks apply a round in different batches (``abs_sgd``) ends otherwise.
        """
        self._trainer.should_stop = True

    # ------------------------------------------------------------- training
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Every rank, main thread: the agreed stop (Lightning before 2.6); the saves the applied rounds called
        for; then rank 0's clock."""
        self._check_stop_at_batch_start()
        self._run_pending_saves(before=self._save_boundary)
        if self._clock is not None:
            self._clock.at_batch_start(self._trainer)

    def _check_stop_at_batch_start(self) -> None:
        """Every rank, main thread, at a batch start: on a Lightning without the per-batch SIGTERM broadcast
        (before 2.6; its own check comes at the batch's end, per rank), ``SIGTERMException`` once a round carried
        a stop (:meth:`_stop_now`), so that every rank stops at the same batch as under 2.6."""
        if self._stop_check_at_batch_start:
            _compat.raise_if_stop_requested(self._trainer, self._stop_now)

    def _with_presence(self, tensors: list[torch.Tensor], params: list[torch.nn.Parameter],
                       present: Optional[list[bool]] = None) -> list[torch.Tensor]:
        """``tensors``, and with ``find_unused_parameters`` (the gradient strategies) one number per parameter
        after them: 1 where it has a gradient (``present``; all by default, as an engine's layout), in the first
        parameter's dtype and device. Summed with the gradients, they say which parameters some contribution
        used (:meth:`_set_gradients`)."""
        if not self.find_unused_parameters:
            return tensors
        flags = [True] * len(params) if present is None else present
        return [*tensors, torch.tensor(flags, dtype=params[0].dtype).to(params[0].device, non_blocking=True)]

    def _set_gradients(self, params: list[torch.nn.Parameter], values: list[torch.Tensor], *,
                       known_used: bool = False) -> None:
        """Gradients (a round's, or a step's sum) into ``p.grad``; with ``find_unused_parameters`` ``values``
        end with the presence sums (:meth:`_with_presence`), and a parameter no contribution used keeps
        ``grad = None`` (no momentum, no weight decay), as under DDP.

        ``known_used``: every parameter is known to be used (the presence sums are not read).
        """
        used = [True] * len(params)
        if self.find_unused_parameters:
            *values, presence = values
            if not known_used:
                used = presence.gt(0).tolist()  # the same sums on every rank: the same parameters stepped
        for p, g, u in zip(params, values, used):
            if not u:
                p.grad = None  # globally unused: untouched, as under DDP
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def _stop_now(self) -> bool:
        """Every rank, main thread, at each batch start (in place of Lightning's SIGTERM broadcast): whether a
        round carried a stop, after the saves queued by the rounds before it.

        Every rank queues those saves, each collective; a rank that applies round ``r`` and the stop
        round in one batch (``abs_sgd``, whose ranks apply a round in batches of their own) would
        otherwise stop with ``r``'s save queued while a rank that applied ``r`` a batch earlier runs it
        and waits in its collectives for the stopped ones. The saves of the stop round itself run on no
        rank. (Where every rank applies round ``r`` in step ``r``, none is left by then.)
        """
        if not self._stopped:
            return False
        self._saves_before_stop()
        return True

    def _saves_before_stop(self) -> None:
        """The queued saves called for by the rounds before the stop round, the others dropped (every rank)."""
        self._run_pending_saves(before=self._stop_round)
        self._pending_saves.clear()

    def _run_pending_saves(self, before: Optional[int] = None) -> None:
        """Every rank, main thread, collective (each save is): the queued saves in the order queued, those
        called for by rounds before ``before`` only if given."""
        self._running_saves = True
        try:
            while self._pending_saves and (before is None or self._pending_saves[0][0] < before):
                self._pending_saves.pop(0)[1]()
        finally:
            self._running_saves = False

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: StepModel = None,
        **kwargs: Any,
    ) -> Any:
        """The subclass's :meth:`_engine_step` for an optimizer with an engine; Lightning's step otherwise
        (not fitting, or no trainable parameter)."""
        index = self._optimizer_index(optimizer)
        if self._store is not None:
            self._check_trainable(index)
        if index not in self._engines:
            return self._lightning_step(optimizer, closure, model, kwargs)
        return self._engine_step(index, optimizer, closure, model, kwargs)

    def _check_trainable(self, index: int) -> None:
        """Every rank, main thread, at each step of a fit: optimizer ``index``'s trainable parameters are those
        its engine took at train start; ``RuntimeError`` naming the others otherwise (no collective).

        An engine's layout is fixed when it starts. A parameter made trainable later (``BaseFinetuning``'s
        unfreeze adds it to the optimizer) would train on each rank alone, the replicas drifting apart without
        a sign (as under DDP, whose reducer also keeps the parameters it was built with); one frozen later
        would still be moved by the other ranks' gradients or averages. Refused on one rank too, so that a fit
        that runs on one device runs on many. A callback makes the change at the same step on every rank
        under eager_sgd and model averaging, so every rank raises at that step; under abs_sgd, whose ranks
        start an epoch at different rounds, the first to get there raises and the others end with a failed
        round.
        """
        taken = self._params.get(index, [])
        trainable = _trainable(self.optimizers[index])
        if len(trainable) == len(taken) and all(a is b for a, b in zip(trainable, taken)):
            return
        taken_ids, trainable_ids = {id(p) for p in taken}, {id(p) for p in trainable}
        if taken_ids == trainable_ids:
            return  # the same parameters, reordered: the engine keeps its own order
        names = {id(p): name for name, p in self.lightning_module.named_parameters()} if self.lightning_module else {}

        def listed(params: list[torch.nn.Parameter]) -> str:
            shown = [repr(names.get(id(p), f"a {tuple(p.shape)} tensor")) for p in params[:3]]
            return ", ".join(shown) + (f" and {len(params) - 3} more" if len(params) > 3 else "")

        added = [p for p in trainable if id(p) not in taken_ids]
        removed = [p for p in taken if id(p) not in trainable_ids]
        changes = []
        if added:
            changes.append(f"{len(added)} became trainable ({listed(added)})")
        if removed:
            changes.append(f"{len(removed)} stopped being trainable ({listed(removed)})")
        raise RuntimeError(
            f"{self.strategy_name}: the trainable parameters of optimizer {index} changed after the fit started "
            f"(step {self._trainer.global_step}): {'; '.join(changes)}. The strategy synchronises the parameters "
            "that are trainable when training starts, for the whole fit (a parameter unfrozen later would train "
            "outside it, on each rank alone). Fix the trainable set before fit: to unfreeze later (BaseFinetuning, "
            "BackboneFinetuning), make the parameters trainable from the start in a param group whose learning "
            "rate is 0 until then"
        )

    def _lightning_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: StepModel,
                        kwargs: dict[str, Any]) -> Any:
        """Lightning's own step: precision plugin, ``on_before_optimizer_step`` hooks, clipping, ``optimizer.step``."""
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @abstractmethod
    def _engine_step(self, index: int, optimizer: Optimizer, closure: Callable[[], Any], model: StepModel,
                     kwargs: dict[str, Any]) -> Any:
        """Every rank, main thread: optimizer ``index``'s step, handing its tensors to its engine."""

    def _optimizer_index(self, optimizer: Optimizer) -> int:
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        for i, opt in enumerate(self.optimizers):
            if opt is inner or opt is optimizer:
                return i
        raise ValueError("optimizer_step() got an optimizer that the strategy did not set up")

    @abstractmethod
    def _final_round(self, index: int, engine: EngineT) -> RoundStats:
        """Every rank, main thread: the engine's flush and applying its result."""

    @override
    def on_train_end(self) -> None:
        """The saves still queued, then the final round of every engine: nothing pending is lost, replicas
        end identical."""
        if not self._stopped:
            self._run_pending_saves()
        if self._stopped:
            self._saves_before_stop()
            # A stop request ended the engines at the same round on every rank. Usually the next
            # batch start then raises SIGTERMException and this hook never runs; it runs when the
            # stop rode in the last step's round (the fit loop ended first). Then every rank is
            # here: no flush is possible (what was carried is not applied), but what the final
            # round would have made identical is, over the collective group.
            self._end_after_stop()
            self._close_engines()
            self._average_buffers()
            self._release_store(agreed=True)
            return
        for index, engine in list(self._engines.items()):
            stats = self._final_round(index, engine)
            self._final_states[index] = engine.state_dict()  # nothing pending: for a checkpoint after fit
            self.round_stats[index] = stats
        self._close_engines()
        self._average_buffers()
        self._release_store(agreed=True)

    @override
    def _last_round(self) -> Optional[int]:
        rounds = [stats.round_index for stats in self.round_stats.values()]
        if not rounds:
            # A resumed fit before its first round: the last round its checkpoint's engines had reached (a
            # restored engine's next round is the one after it; a fresh one's is 0: none).
            rounds = [engine.step - 1 for engine in self._engines.values() if engine.step > 0]
        return max(rounds, default=None)

    @override
    def _naming_failure(self, what: str) -> contextlib.AbstractContextManager[None]:
        """As the base class's, and naming the rank that is gone where this rank's heartbeat has a verdict
        (:meth:`_verdict`)."""
        return naming_failure(what, rank=self.global_rank, round_index=self._last_round(), last=True,
                              verdict=self._verdict)

    def _verdict(self, err: BaseException) -> Optional[PartialCollectiveError]:
        """Main thread, after one of the strategy's collectives failed with torch's ``err``: the heartbeat's
        verdict on a rank that is gone, if one comes (``None`` without a running heartbeat).

        As an engine's failed round asks it (``RoundRunner._explain``): after a timeout up to two beats, in
        which the heartbeat may name the rank that stopped (with ``collective_timeout >= timeout`` the group's
        bound and the heartbeat's are the same); after any other failure (a peer's process is gone, its
        heartbeat silent for moments) one fresh read of the store, for a verdict some rank published.
        """
        heartbeat = self._heartbeat
        if heartbeat is None:
            return None
        return heartbeat.verdict_after_failure(timed_out=error_kind(err) is PartialCollectiveTimeout)

    def _release_store(self, *, agreed: bool) -> None:
        """Drops this rank's client of the engines' store; rank 0's is its server, which then closes.

        ``agreed``: every rank is here (the end of fit), so a barrier first makes sure that no
        rank still uses the store (its engines' last key deletions) when rank 0 closes it.
        Without it (teardown after a failure), the store is dropped at once. Either way a
        later fit in the same process starts from a new store: none is left behind.
        """
        if self._store is None:
            return
        if agreed and self.world_size > 1 and _compat._distributed_is_initialized():
            self.barrier("lightning_partial: release the store")
        self._store = None

    def _end_after_stop(self) -> None:
        """Every rank, main thread, at the end of a fit whose last step's round carried a stop: the part of
        the final round that needs no engine. Here nothing: the gradient strategies' parameters are
        identical after every round."""

    def _mean_over_ranks(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Every rank, main thread, collective group: each floating-point tensor replaced in place by its mean
        over the ranks, any other by rank 0's (one allreduce per dtype, bounded by the group's timeout;
        :func:`~lightning_partial.strategies.rank_mean.mean_in_place`). Nothing on one rank. A failed
        allreduce (a peer that died, or did not come within the timeout) raises
        :class:`PartialCollectiveError` naming this rank, ``what`` and the last round this rank saw."""
        if self.world_size < 2 or not _compat._distributed_is_initialized():
            return
        mean_in_place(tensors, rank=self.global_rank, world_size=self.world_size,
                      sum_=allreduce_sum(self.collective_group, rank=self.global_rank, what=what,
                                         last_round=self._last_round()))

    def _average_buffers(self) -> None:
        """Every rank, main thread, collective group, once at the end of fit: makes the buffers identical.

        Buffers (BatchNorm's running statistics) are never exchanged per step:
        each replica tracks its own data's, where DDP broadcasts rank 0's before
        every forward. At the end of fit floating-point buffers are replaced by
        their mean over the ranks (statistics of all the data, not one rank's)
        and the others (``num_batches_tracked``) by rank 0's, so that the replicas
        end identical, buffers included.
        """
        if self.lightning_module is None:
            return
        self._mean_over_ranks([b for b in self.lightning_module.buffers() if b.numel()], "the end-of-fit buffers")

    def _close_engines(self) -> None:
        self._pending_saves.clear()  # saves called for by rounds after the last batch: none is taken
        trainer = self._attached_trainer
        if trainer is not None:
            # Lightning's own handling back, for a later fit of this trainer.
            if self._clock is not None:
                self._clock.restore(trainer)
            _compat.restore_sigterm_broadcast(trainer)
        self._clock = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._previous_sigterm_handler is not None:
            _compat.restore_sigterm_handler(self._previous_sigterm_handler)
            self._previous_sigterm_handler = None
        self._stop_check_at_batch_start = False
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        self._params.clear()

    # ---------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Every rank: its engines' state (round, RNG, pending gradients) is gathered into rank 0's file.

        One ``gather_object`` on the collective group per checkpoint (see
        :mod:`lightning_partial.strategies.checkpoint` for why the cut is consistent).
        Rank 0 writes the file atomically (a temporary file in the same directory,
        then ``os.replace``) with the default ``TorchCheckpointIO`` and a local path;
        remote paths and other ``CheckpointIO`` plugins keep their own behaviour.
        """
        from lightning_partial.strategies.checkpoint import write_checkpoint

        for state in self._fit_states():
            # Identical on every rank (rank 0 writes it), so that a resumed fit goes on as the
            # uninterrupted one would have (prediction's last update, abs_sgd's accumulated rounds).
            state.save(checkpoint)
        if self.find_unused_parameters:
            checkpoint[LAYOUT_KEY] = {"find_unused_parameters": True}
        states = {i: e.state_dict() for i, e in self._engines.items()} or dict(self._final_states)
        if states and _compat._distributed_is_initialized():
            entry = gather_engine_states(
                states,
                rank=self.global_rank,
                world_size=self.world_size,
                strategy=self.strategy_name,
                family=self.engine_family,
                group=self.collective_group,
                verdict=self._verdict,
            )
            if entry is not None:
                checkpoint[CHECKPOINT_KEY] = entry
        if self.is_global_zero:  # as Strategy.save_checkpoint, with an atomic write
            write_checkpoint(self.checkpoint_io, checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Keeps the engines' state of a checkpoint for the engines created at ``on_train_start``.

        Raises ``CheckpointMismatchError`` (a ``ValueError``), before set-up ends, for engine
        state this strategy cannot resume: another engine family's, or one saved while the
        ranks were at different rounds (see :func:`~lightning_partial.strategies.checkpoint.resume_entry`).
        Only when fitting: validate / test / predict load the weights and never touch the engines.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = self._attached_trainer
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            self._resume_state = None
            for state in self._fit_states():
                state.forget_loaded()
            return checkpoint
        for state in self._fit_states():
            state.load(checkpoint)
        self._resume_state = resume_entry(
            checkpoint.get(CHECKPOINT_KEY), strategy=self.strategy_name, family=self.engine_family,
            source=checkpoint_path,
        )
        saved = bool((checkpoint.get(LAYOUT_KEY) or {}).get("find_unused_parameters", False))
        if self._resume_state is not None and saved != self.find_unused_parameters:
            raise CheckpointMismatchError(
                f"the checkpoint was saved with find_unused_parameters={saved}, and its engine state (pending "
                f"gradients, results not yet applied) has that layout: resume with find_unused_parameters={saved}, "
                "or drop the engine state with lightning_partial.strategies.checkpoint.drop_engine_state(src, dst)",
                source=checkpoint_path,
            )
        return checkpoint

    @override
    def teardown(self) -> None:
        """Every rank: a resumed fit whose loop ran no batch ends first (:meth:`_end_a_fit_without_batches`), then
        what the fit holds is released (:meth:`_release_fit`, the engines, the store)."""
        self._end_a_fit_without_batches()
        self._resume_state = None  # a checkpoint's engine state is for the fit that loaded it, used or not
        for state in self._fit_states():
            state.forget_loaded()  # likewise its fit states (a fit that failed before on_train_start left them)
        self._release_fit()
        self._close_engines()
        self._release_store(agreed=False)
        module = self.lightning_module
        if (self._layer_sync is not None and module is not None and module._trainer is not None
                and module._trainer.state.fn == TrainerFn.FITTING and self.model is not None):
            # sync_batchnorm=True (mode="sync" only): the user's module leaves the fit with the layers it
            # came with, as under DDP; a later fit of it under a partial mode is otherwise refused.
            self.model = self._layer_sync.revert(self.model)
        super().teardown()

    def _release_fit(self) -> None:
        """Every rank, at teardown, after the end of fit: what a subclass's fit holds beyond the engines."""

    def _end_a_fit_without_batches(self) -> None:
        """Every rank, main thread, at teardown: a fit resumed from a checkpoint whose training was done already
        (saved at the last step: Lightning's loop skips every hook, ``on_train_start`` and ``on_train_end``
        included) still ends as a fit does, so that the checkpoint's pending work is applied as the fit that
        saved it applied it right after the save: carried gradients (the final flush), an overlapped round's
        result, the final global average. Only where the fit completed (not after an exception) and its
        engines never started (the checkpoint's engine state still unused): the same on every rank, which all
        resumed the same file. A checkpoint saved after fit holds nothing pending: its flush applies nothing.
        """
        trainer = self._attached_trainer
        if (self._resume_state is None or trainer is None or trainer.state.fn != TrainerFn.FITTING
                or trainer.state.status != TrainerStatus.RUNNING or self._engines
                or not trainer.fit_loop.done or trainer.limit_train_batches == 0):
            return  # (limit_train_batches=0 skips the loop too, with training not done: nothing ends then)
        log.info("rank %d: the resumed checkpoint's training was done; its pending work is applied as at the end "
                 "of fit", self.global_rank)
        self.on_train_start()
        self.on_train_end()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers ``registry_entries`` and their ``_spawn`` and ``_fork`` twins (idempotent: importing twice is fine)."""
        for name, description, options in cls.registry_entries:
            for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
                if name + suffix in strategy_registry:
                    continue
                strategy_registry.register(
                    name + suffix, cls, description=f"{description}, start_method '{start_method}'",
                    start_method=start_method, **options,
                )


class ConfiguredStrategy(PartialStrategy[EngineT]):
    """A strategy whose engines run rounds of one :class:`PartialAllreduceConfig` (eager-SGD, model averaging).

    Subclasses set :attr:`partial_config` in their constructor; its ``mode`` says whether
    every round is synchronous, and it checks the world size at set-up.
    """

    partial_config: PartialAllreduceConfig

    def _round_config(self, index: int, **changes: Any) -> PartialAllreduceConfig:
        """The configuration of optimizer ``index``'s engine for this fit: :attr:`partial_config`, ``changes``,
        and ``sync_from``.

        ``sync_from`` places the synchronous finish (``final_sync``) against
        ``trainer.estimated_stepping_batches``: the same round on every rank.
        """
        return replace(self.partial_config, sync_from=self._finish_from(index), **changes)

    def _rounds_in(self, index: int, steps: int) -> int:
        """The rounds of optimizer ``index``'s engine in its next ``steps`` optimizer steps (negative: back
        into the finish): one per step here (model averaging's local steps join fewer)."""
        return steps

    def _finish_from(self, index: int) -> Optional[int]:
        """The first round of the synchronous finish of optimizer ``index``'s engine (``None``: no finish).

        The last ``final_sync`` of the fit's optimizer steps, as ``trainer.estimated_stepping_batches`` counts
        them (a round per optimizer step, or per ``average_every`` steps under model averaging's local steps,
        :meth:`_rounds_in`;
        under manual optimization with several optimizers ``max_steps`` counts every
        optimizer's steps, and how each engine's rounds share them is not known in advance: the finish is
        placed in the fit's steps, as for one optimizer, and rank 0 also asks for it at that global step,
        :meth:`_finish_at_step`; a time limit likewise, by the clock), placed from the engine's first round
        (``_first_round``) by the rounds this fit still runs: a new fit starts at round 0, a resumed one at its
        checkpoint's round, so the finish falls where it would have. On
        another world size an epoch-bound fit's steps so far count at the old size's rate (an epoch is
        ``P_old / P`` times as many steps now), so the finish stays the last ``final_sync`` of the steps run.
        """
        if not self.final_sync:
            return None
        trainer = self._trainer
        rounds = trainer.estimated_stepping_batches
        by_steps = trainer.max_steps != -1 and rounds >= trainer.max_steps
        first = first_sync_round(self.final_sync, rounds, owner=self.strategy_name, rank=self.global_rank,
                                 by_time=self.finish_by_time and _compat.step_timer_budget(trainer) is not None)
        if first is None:
            return None
        done = trainer.global_step
        if not by_steps and self._saved_world_size != self.world_size:
            done = round(done * self._saved_world_size / self.world_size)
        ahead = max(0, int(rounds) - done) - (int(rounds) - first)  # optimizer steps until the finish
        # Below the first round where the fit resumed inside its finish: the same index as the fit that saved
        # it with a round per step (model averaging's finish="gradients" starts its finish once, at that round),
        # at or below it with local steps (average_every, which refuses finish="gradients").
        return max(0, self._first_round + self._rounds_in(index, ahead))

    @override
    def _first_round_without_state(self, trainer: "pl.Trainer") -> int:
        """A round per optimizer step (per :attr:`_steps_per_round`): a fit resumed at ``global_step`` without
        engine state numbers its rounds on from there, as with the state, so that the finish (``sync_from``),
        ``sync_every`` and the group schedules fall at the same steps as in the fit that saved it."""
        return trainer.global_step // self._steps_per_round

    @property
    @override
    def synchronous(self) -> bool:
        return self.partial_config.mode == "sync"

    @override
    def validate_world(self, world_size: int) -> None:
        self.partial_config.validate_world(world_size)
