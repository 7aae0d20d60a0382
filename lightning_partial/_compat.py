"""Every private Lightning API this package touches, in one place.

Lightning's strategies are built from private helpers (launchers, process-group
set-up, module-state sync). Importing them here, and only here, means a
Lightning upgrade that moves one breaks one file, with a clear error.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Callable, Optional

import torch

from lightning.fabric.utilities.distributed import (  # noqa: F401 - re-exported
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group  # noqa: F401
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # noqa: F401
from lightning.fabric.utilities.seed import reset_seed  # noqa: F401
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: F401
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher  # noqa: F401
from lightning.pytorch.trainer.call import _interrupt
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.fabric.utilities.apply_func import move_data_to_device

log = logging.getLogger(__name__)


# --------------------------------------------------------------- shadowing
# Where a strategy changes what a Lightning object does during a fit, it puts a function in front of the
# object's method (an instance attribute named as the method), never patching the class: other trainers are
# untouched, and taking the attribute away gives the method back exactly.
def _shadow(obj: Any, name: str, replacement: Callable[..., Any]) -> None:
    """Makes ``obj.name`` call ``replacement`` (this object only) until :func:`_unshadow`."""
    obj.__dict__[name] = replacement


def _unshadow(obj: Any, name: str) -> None:
    """Undoes :func:`_shadow` (idempotent; nothing to do for ``obj`` ``None``)."""
    if obj is not None:
        obj.__dict__.pop(name, None)


def _shadowing(obj: Any, name: str) -> Optional[Callable[..., Any]]:
    """The replacement :func:`_shadow` put in front of ``obj.name`` (``None``: the method is the class's)."""
    return obj.__dict__.get(name) if obj is not None else None


def _epoch_loop(trainer: Any) -> Any:
    return getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)


class StopAwareMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher (``start_method`` ``"spawn"`` or ``"fork"``) for fits that SIGTERM can stop.

    Under Lightning's own launcher a rank that raises ``SIGTERMException`` (a
    ``SystemExit``) leaves its process with status 0 without handing rank 0's
    results to the parent, which then waits for them forever in
    ``return_queue.get()`` (Lightning 2.6: ``ddp_fork`` hangs the same way). Here
    every rank handles the stop as it does under the script launcher, through
    Lightning's ``_interrupt`` (the callbacks' ``on_exception``: an
    ``OnExceptionCheckpoint`` saves from the ranks, which hold the optimizer and
    engine state; the strategy's; the loggers' ``finalize("failed")``) and
    teardown, and rank 0 then hands its results over as at the end of a fit. The
    parent's ``trainer.fit`` returns with rank 0's weights loaded and
    ``trainer.interrupted`` true. It does not raise: that would run every
    callback's ``on_exception`` a second time, in a process without the ranks'
    state (an ``OnExceptionCheckpoint`` there would overwrite rank 0's checkpoint).

    Any other ``SystemExit`` inside a rank's fit, or in the stop's handling,
    becomes a ``RuntimeError`` naming the rank, which torch's process context
    reports to the parent (status 0 with no results would hang it the same way).

    This runs in the ranks only: Lightning installs no SIGTERM handler in the
    launching process, so a SIGTERM to the whole process group (SLURM, ``docker
    stop``) ends that process outright, as under Lightning's own launcher.
    """

    def _wrapping_function(self, process_idx: int, trainer: Any, function: Callable, args: Any, kwargs: Any,
                           return_queue: Any, global_states: Any = None) -> None:
        try:
            try:
                super()._wrapping_function(process_idx, trainer, function, args, kwargs, return_queue, global_states)
            except SIGTERMException as stop:
                if trainer is None:
                    raise
                # What _call_and_handle_interrupt does in a script-launched rank, then the end of a fit's hand-over.
                _interrupt(trainer, stop)
                trainer._teardown()
                trainer.state.stage = None
                results = self._collect_rank_zero_results(trainer, None)
                if process_idx == 0:
                    return_queue.put(move_data_to_device(results, "cpu"))
                log.info("rank %d: stopped by SIGTERM at global step %d; results handed to the launching process",
                         trainer.global_rank, trainer.global_step)
        except SystemExit as exit_:
            rank = trainer.global_rank if trainer is not None else process_idx
            raise RuntimeError(f"rank {rank} (local process {process_idx}) raised SystemExit({exit_.code!r}) inside "
                               "the fit; the launching process would otherwise wait for results that never come"
                               ) from exit_


def replace_sigterm_broadcast(trainer: object, stop_requested: Callable[[], bool]) -> bool:
    """Replaces Lightning's per-batch SIGTERM broadcast with a local, non-blocking check.

    Lightning 2.6's training loop calls ``_broadcast_sigterm_tensor`` at the start
    of every batch: a ``dist.broadcast`` from rank 0, i.e. a global synchronisation
    per step that makes every fast rank wait for rank 0 (Lightning #20825,
    #21487). Our strategies exist to avoid exactly that. The replacement asks
    ``stop_requested()`` (a store look-up, no collective) and raises
    ``SIGTERMException`` on every rank once any rank received SIGTERM.

    Returns whether the method was found and replaced (``False`` on a Lightning
    without it, where there is nothing to replace).
    """
    loop = _epoch_loop(trainer)
    if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor"):
        # Lightning before 2.6: the strategy runs the same check at its batch start instead.
        log.debug("no _broadcast_sigterm_tensor on this Lightning: nothing to replace")
        return False
    _shadow(loop, "_broadcast_sigterm_tensor", lambda: raise_if_stop_requested(trainer, stop_requested))
    return True


def raise_if_stop_requested(trainer: object, stop_requested: Callable[[], bool]) -> None:
    """At a batch start, on every rank: ``SIGTERMException`` once ``stop_requested()`` (a local check, no
    collective), with ``trainer.received_sigterm`` set as Lightning's own handler would have set it."""
    if stop_requested():
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            connector.received_sigterm = True
        raise SIGTERMException()


def restore_sigterm_broadcast(trainer: Any) -> None:
    """Undoes :func:`replace_sigterm_broadcast` (idempotent)."""
    _unshadow(_epoch_loop(trainer), "_broadcast_sigterm_tensor")


def can_stop_early(trainer: Any) -> bool:
    """Whether ``min_steps`` / ``min_epochs`` are met (Lightning's own check before a stop by a callback)."""
    return bool(getattr(trainer.fit_loop, "_can_stop_early", True))


def _step_timers(trainer: Any) -> list[Any]:
    """The trainer's ``Timer`` callbacks that check their limit at every batch end (the one ``max_time`` adds)."""
    from lightning.pytorch.callbacks.timer import Interval, Timer

    return [
        callback for callback in getattr(trainer, "callbacks", [])
        if isinstance(callback, Timer) and getattr(callback, "_interval", None) == Interval.step
        and getattr(callback, "_duration", None) is not None and hasattr(callback, "time_elapsed")
    ]


def step_timer_budget(trainer: Any) -> Optional[tuple[Callable[[], float], float]]:
    """The per-step ``Timer`` of ``Trainer(max_time=...)`` (the shortest, where a user added more): its training
    time elapsed (a callable, in seconds, restored with the Timer's state on a resume) and its duration;
    ``None`` without one."""
    timers = _step_timers(trainer)
    if not timers:
        return None
    timer = min(timers, key=lambda t: float(t._duration))
    return timer.time_elapsed, float(timer._duration)


def take_over_step_timers(trainer: Any, request_finish: Callable[[], None]) -> None:
    """Replaces each per-step ``Timer``'s broadcast (``Trainer(max_time=...)``) with ``request_finish``.

    Lightning's ``Timer`` with ``interval="step"`` (the one ``max_time`` adds) calls
    ``trainer.strategy.broadcast`` at every batch end: rank 0's "time is up" sent
    to every rank, a collective per step that ties every rank to rank 0's pace and,
    under ``abs_sgd``, whose ranks run different numbers of batches, pairs with
    another rank's unrelated collective (the fit then hangs until the timeout). Here
    the Timer's batch-end check asks rank 0's clock alone, as Lightning's does, and
    calls ``request_finish()`` once it is up, on rank 0 only: the strategy carries
    the request in its rounds and ends every rank's fit at the same round. The
    Timer's other checks (at fit start, ``interval="epoch"``) keep their broadcast:
    every rank makes them at the same point.
    """
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    for callback in _step_timers(trainer):
        requested = [False]  # this rank has requested the finish (once per fit)

        def on_train_batch_end(trainer: Any, *args: Any, _timer: Any = callback, _requested: list[bool] = requested,
                               **kwargs: Any) -> None:
            if trainer.global_rank != 0 or _requested[0]:
                return
            if not can_stop_early(trainer):
                return  # min_steps / min_epochs not met: Lightning would go on anyway (asked again next batch)
            if _timer.time_elapsed() >= _timer._duration:
                _requested[0] = True
                request_finish()
                if getattr(_timer, "_verbose", False):
                    rank_zero_info(f"Time limit reached. Elapsed time is {int(_timer.time_elapsed())} s. "
                                   "Signaling every rank to stop at the same round.")

        _shadow(callback, "on_train_batch_end", on_train_batch_end)
        on_train_batch_end.timer_taken_over = True  # type: ignore[attr-defined]


def restore_step_timers(trainer: Any) -> None:
    """Undoes :func:`take_over_step_timers` (idempotent)."""
    for callback in getattr(trainer, "callbacks", []):
        if getattr(_shadowing(callback, "on_train_batch_end"), "timer_taken_over", False):
            _unshadow(callback, "on_train_batch_end")


def time_validation_interval(trainer: Any) -> Optional[float]:
    """``Trainer(val_check_interval=<a time>)``'s interval in seconds; ``None`` if validation is by batches."""
    return getattr(trainer, "_val_check_time_interval", None)


def time_since_validation(trainer: Any, now: float) -> float:
    """Seconds since the fit's start or its last validation (Lightning's clock for time-based validation)."""
    last = getattr(trainer, "_last_val_time", None)
    return 0.0 if last is None else now - last


def take_over_time_validation(trainer: Any, due: Callable[[], bool]) -> bool:
    """Makes time-based validation (``val_check_interval`` a time) happen where ``due()`` says, not by each
    rank's own clock; returns whether it was taken over.

    Lightning 2.6's epoch loop validates when *this rank's* clock has passed the
    interval since its last validation, with no agreement between ranks: ranks whose
    batches end at different times would validate at different steps (and a rank
    that validates waits in the validation's collectives for ranks that do not).
    The wrapped check answers as Lightning's would with the clock left out, or
    ``due()``: the strategy agrees on the step through its rounds.
    """
    loop = _epoch_loop(trainer)
    original = getattr(loop, "_should_check_val_fx", None)
    if original is None or time_validation_interval(trainer) is None:
        return False

    def _should_check_val_fx(*args: Any, **kwargs: Any) -> bool:
        last = trainer._last_val_time
        trainer._last_val_time = float("inf")  # the clock's part: never
        try:
            by_loop = original(*args, **kwargs)
        finally:
            trainer._last_val_time = last
        agreed = due()  # asked every batch end: a due validation is taken once, even where the loop validates
        epoch_validates = getattr(loop, "_should_check_val_epoch", lambda: True)()
        return bool(by_loop) or (agreed and epoch_validates)

    _shadow(loop, "_should_check_val_fx", _should_check_val_fx)
    return True


def restore_time_validation(trainer: Any) -> None:
    """Undoes :func:`take_over_time_validation` (idempotent)."""
    _unshadow(_epoch_loop(trainer), "_should_check_val_fx")


def install_sigterm_handler(handler: Callable[[int, Any], None]) -> Any:
    """Installs ``handler`` for SIGTERM in place of Lightning's; returns the previous one.

    Lightning 2.6's ``_SignalConnector._sigterm_notifier_fn`` runs a
    ``dist.broadcast`` from rank 0 inside the handler (a collective that blocks a
    rank other than 0 forever when rank 0 is not broadcasting too) and forwards
    the signal to the launcher's children. Only the main thread may install one.
    """
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)
    return previous


def restore_sigterm_handler(previous: Any) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------- abs_sgd
def mark_last_batch(trainer: Any) -> None:
    """Makes the batch now starting the epoch's last one (the epoch ends after it, with its validation).

    Lightning sets ``batch_progress.is_last_batch`` from the data fetcher just
    before ``on_train_batch_start``; an elastic (length-less) loader never ends,
    so ABS-SGD ends the epoch here, at the round that completed the epoch's
    global samples.
    """
    trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True


def add_optimizer_steps(trainer: Any, delta: int) -> None:
    """Adds ``delta`` (may be negative) to Lightning's optimizer-step counter (``trainer.global_step``).

    Called from ``Strategy.optimizer_step``, before Lightning's own increment of
    one: a micro-batch that applied ``k`` round results then counts ``k`` steps.
    """
    progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step
    for tracker in (progress.total, progress.current):
        tracker.ready += delta
        tracker.completed += delta


def step_schedulers_by_rounds(trainer: Any) -> bool:
    """Stops Lightning's per-batch stepping of ``interval="step"`` LR schedulers (see :func:`step_round_schedulers`).

    Lightning steps them after every training batch (``_update_learning_rates``,
    ``frequency`` counted in batches). Under ABS-SGD a rank's batches are its
    own micro-batches, as many as its speed allows, while the optimizer steps
    once per *round*, the same rounds on every rank but within different
    batches: stepping per batch would give the ranks different learning rates
    and the replicas would drift apart. The strategy steps them per round
    instead, right after each round's ``optimizer.step()``. Plateau schedulers
    and ``interval="epoch"`` keep Lightning's handling (epochs end at the same
    round on every rank). Returns whether this Lightning had the method.
    """
    loop = trainer.fit_loop.epoch_loop
    original = getattr(loop, "_update_learning_rates", None)
    if original is None:
        log.debug("no _update_learning_rates on this Lightning: schedulers step per batch")
        return False

    def _update_learning_rates(interval: str, update_plateau_schedulers: bool) -> None:
        if interval != "step" or update_plateau_schedulers:
            original(interval=interval, update_plateau_schedulers=update_plateau_schedulers)

    _shadow(loop, "_update_learning_rates", _update_learning_rates)
    return True


def step_round_schedulers(trainer: Any, optimizer: Any, step_index: int) -> None:
    """After the optimizer's step ``step_index`` (from 0): steps that optimizer's ``interval="step"`` schedulers.

    ``frequency`` counts these steps (under ABS-SGD, one per ``step_samples``'
    worth of rounds). What Lightning's loop would do per batch (progress
    counters, the ``lr_scheduler_step`` hook), per optimizer step.
    """
    from lightning.pytorch.trainer import call

    loop = trainer.fit_loop.epoch_loop
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.reduce_on_plateau:
            continue
        if getattr(config.scheduler, "optimizer", optimizer) is not optimizer:
            continue
        if (step_index + 1) % config.frequency == 0:
            loop.scheduler_progress.increment_ready()
            call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)
            loop.scheduler_progress.increment_completed()


def restore_scheduler_stepping(trainer: Any) -> None:
    """Undoes :func:`step_schedulers_by_rounds` (idempotent)."""
    _unshadow(_epoch_loop(trainer), "_update_learning_rates")


def before_optimizer_step(precision_plugin: Any, model: Any, optimizer: Any) -> None:
    """What Lightning runs between the closure and ``optimizer.step()``: the hooks, then gradient clipping."""
    precision_plugin._after_closure(model, optimizer)


# The ModelCheckpoint attributes whose batch-end saves a strategy takes over, and their "off" values.
_BATCH_END_TRIGGERS = {"_every_n_train_steps": 0, "_train_time_interval": None}


def _quiet_batch_end(callback: Any, trigger: str) -> None:
    """Runs ``callback``'s ``on_train_batch_end`` with ``trigger`` off (added to those already off).

    Only the hook sees the trigger off: the attribute keeps its value everywhere
    else, so ``ModelCheckpoint.state_key`` (the key of its state in a checkpoint,
    built from these attributes) stays the user's, and a resumed fit finds it.
    """
    wrapper = _shadowing(callback, "on_train_batch_end")
    quiet: Optional[set[str]] = getattr(wrapper, "quiet_triggers", None)
    if quiet is None:
        quiet = set()
        hook = type(callback).on_train_batch_end

        def on_train_batch_end(*args: Any, **kwargs: Any) -> None:
            kept = {name: getattr(callback, name) for name in quiet}
            for name in quiet:
                setattr(callback, name, _BATCH_END_TRIGGERS[name])
            try:
                hook(callback, *args, **kwargs)
            finally:
                for name, value in kept.items():
                    setattr(callback, name, value)

        on_train_batch_end.quiet_triggers = quiet  # type: ignore[attr-defined]
        _shadow(callback, "on_train_batch_end", on_train_batch_end)
    quiet.add(trigger)


def take_over_step_checkpoints(callback: Any) -> int:
    """Stops ``ModelCheckpoint`` ``callback`` saving by ``global_step % n`` itself; returns ``n`` (0: none).

    Its other triggers (epoch ends, validation) are left as they are;
    :func:`restore_checkpoint_triggers` gives it back.
    """
    every = int(getattr(callback, "_every_n_train_steps", 0) or 0)
    if every > 0:
        _quiet_batch_end(callback, "_every_n_train_steps")
    return every


def take_over_time_checkpoint(callback: Any) -> Optional[float]:
    """Stops ``ModelCheckpoint`` ``callback`` saving by its ``train_time_interval`` itself; returns the interval
    in seconds (``None``: it has none). :func:`restore_checkpoint_triggers` gives it back.

    Lightning decides such a save with rank 0's clock and broadcasts the decision at
    every batch end (a collective per step, as the ``Timer``'s). Its other triggers
    (steps, epoch ends, validation) are left as they are.
    """
    interval = getattr(callback, "_train_time_interval", None)
    if interval is None:
        return None
    _quiet_batch_end(callback, "_train_time_interval")
    return float(interval.total_seconds())


# ModelCheckpoint's hooks that may save at an epoch end (every rank runs them at the same point).
_EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_end")


def agree_epoch_end_checkpoints(callback: Any) -> None:
    """Runs ``ModelCheckpoint`` ``callback``'s epoch-end hooks on every rank as rank 0 runs them, for a fit whose
    ranks end an epoch at different global steps (``abs_sgd``). :func:`restore_checkpoint_triggers` undoes it.

    Each hook decides from this rank's own values whether to save (``_last_global_step_saved ==
    trainer.global_step``: saved at this step already; with ``save_last="link"`` a link at every epoch
    end otherwise) and how to name the file (the monitor candidates): a rank that decided otherwise
    than another issues a different number of collectives (the save's quiesce, the version counter's,
    the link's barrier) and the ranks fail or hang at the next one. Each hook now first takes rank 0's
    answer to "saved at this step" and rank 0's candidates (one broadcast on the strategy's group).
    """
    for name in _EPOCH_END_HOOKS:
        if _shadowing(callback, name) is None:
            _shadow(callback, name, _as_rank_zero(callback, getattr(type(callback), name)))


def _as_rank_zero(callback: Any, hook: Callable[..., None]) -> Callable[..., None]:
    def run(trainer: Any, pl_module: Any) -> None:
        saved_here = callback._last_global_step_saved == trainer.global_step
        saved_here, candidates = trainer.strategy.broadcast((saved_here, _host_candidates(callback, trainer)), src=0)
        # Lightning compares this with the rank's own step: equal exactly where rank 0's are.
        callback._last_global_step_saved = trainer.global_step if saved_here else -1
        own = _shadowing(callback, "_monitor_candidates")  # a replacement of the user's, kept
        _shadow(callback, "_monitor_candidates", lambda _trainer: dict(candidates))
        try:
            hook(callback, trainer, pl_module)
        finally:
            _unshadow(callback, "_monitor_candidates")
            if own is not None:
                _shadow(callback, "_monitor_candidates", own)

    run.as_rank_zero = True  # type: ignore[attr-defined]
    return run


def restore_checkpoint_triggers(callback: Any) -> None:
    """Undoes :func:`take_over_step_checkpoints`, :func:`take_over_time_checkpoint` and
    :func:`agree_epoch_end_checkpoints` (idempotent)."""
    if getattr(_shadowing(callback, "on_train_batch_end"), "quiet_triggers", None) is not None:
        _unshadow(callback, "on_train_batch_end")
    for name in _EPOCH_END_HOOKS:
        if getattr(_shadowing(callback, name), "as_rank_zero", False):
            _unshadow(callback, name)


def time_since_checkpoint(callback: Any, now: float) -> float:
    """Seconds since ``callback`` last saved by time (Lightning's clock: set at train start and at each such save)."""
    last = getattr(callback, "_last_time_checked", None)
    return 0.0 if last is None else now - last


def save_time_checkpoint(callback: Any, trainer: Any, now: float, *, skip_same_step: bool) -> None:
    """What ``ModelCheckpoint.on_train_batch_end`` does when its time interval is up (automatic optimization).

    Its clock restarts; with a ``monitor`` not logged yet, the save waits for the
    end of the next validation (Lightning's deferral); otherwise top-k and ``last``.
    ``skip_same_step``: not at a global step it has saved at already (Lightning's
    own check, which only holds where every rank is at the same global step).
    """
    callback._last_time_checked = now
    if trainer.fast_dev_run or (skip_same_step and callback._last_global_step_saved == trainer.global_step):
        return  # Lightning saves nothing under fast_dev_run
    candidates = _agreed_candidates(callback, trainer)
    if callback.monitor is not None and callback.monitor not in candidates:
        callback._defer_save_until_validation = True
        return
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def save_step_checkpoint(callback: Any, trainer: Any) -> None:
    """What ``ModelCheckpoint.on_train_batch_end`` does at a step that is due: top-k and ``last``.

    Without its ``_should_skip_saving_checkpoint`` test, which compares this rank's own
    ``global_step`` with the last one saved: every rank must take part in every save.
    """
    if trainer.fast_dev_run:
        return  # Lightning saves nothing under fast_dev_run
    candidates = _agreed_candidates(callback, trainer)
    callback._save_topk_checkpoint(trainer, candidates)
    callback._save_last_checkpoint(trainer, candidates)


def _agreed_candidates(callback: Any, trainer: Any) -> dict[str, Any]:
    """``callback``'s monitor candidates (epoch, step, logged metrics) as rank 0 has them, on every rank.

    Every rank, main thread, at a save every rank takes part in: one ``strategy.broadcast`` (the
    strategy's collective group). ``ModelCheckpoint`` names the file from these values on every rank,
    and its version counter runs a collective per name it tries (``file_exists``) for as long as rank
    0's answer is "exists" and the name is not the one this rank saved last: ranks that name the same
    save differently issue different numbers of collectives, and the next one pairs with the wrong one
    (a failure or a hang). Under ``abs_sgd`` a rank reaches a save at its own global step, so the
    names differ; with rank 0's values every rank decides rank 0's names (the file rank 0 writes) and
    the same top-k updates. The values come as CPU tensors (an object broadcast of a CUDA tensor would
    land on rank 0's device index).
    """
    return trainer.strategy.broadcast(_host_candidates(callback, trainer), src=0)


def _host_candidates(callback: Any, trainer: Any) -> dict[str, Any]:
    """``callback``'s monitor candidates with every tensor on the host (to be sent as an object)."""
    return {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value
            for key, value in callback._monitor_candidates(trainer).items()}


def current_hook(pl_module: Any) -> Optional[str]:
    """The Lightning hook running now on the main thread, ``None`` between hooks (or without a module).

    Lightning names it in ``LightningModule._current_fx_name`` around every module, callback and strategy
    hook it calls (``"training_step"``, ``"on_train_batch_end"``, ...), restoring the outer name after, but
    not when the hook raised: after a failed fit the name of the hook that failed stays, so read it only while
    the caller knows a fit's batches are running.
    """
    return getattr(pl_module, "_current_fx_name", None) if pl_module is not None else None


def forget_current_hook(pl_module: Any) -> None:
    """At a fit's set-up (outside every hook): drops a hook name an earlier, failed fit left (:func:`current_hook`),
    which would otherwise stand for every collective the new fit issues outside a named hook."""
    if pl_module is not None:
        pl_module._current_fx_name = None


def computes_nothing(closure: Any) -> bool:
    """Whether ``closure`` is the one Lightning hands ``optimizer_step`` for an ``opt.step()`` called without a
    closure (manual optimization after ``manual_backward``): the gradient exists before the step."""
    from lightning.pytorch.core.optimizer import do_nothing_closure

    return closure is do_nothing_closure


def skippable_closure(closure: Any) -> bool:
    """Whether ``closure`` is Lightning's automatic-optimization closure, which :func:`skip_closure` can mark.

    A ``LightningModule.optimizer_step`` override may hand the strategy a wrapper instead: then the step
    must run the closure (Lightning reads the closure's result after the step).
    """
    from lightning.pytorch.loops.optimization.automatic import Closure

    return isinstance(closure, Closure)


def skip_closure(closure: Any) -> None:
    """Marks Lightning's closure as run with no output, without running it (no ``training_step``, no backward).

    The loop then treats the batch as one whose ``training_step`` returned ``None``.
    """
    from lightning.pytorch.loops.optimization.automatic import ClosureResult

    closure._result = ClosureResult(closure_loss=None)


def logs_this_step(trainer: Any) -> bool:
    """Whether Lightning hands this training batch's step metrics to the loggers.

    Asked in ``on_train_batch_end``, it is the check Lightning's logger connector makes right after that
    hook (none while automatic optimization accumulates; then ``log_every_n_steps``, a stop,
    ``fast_dev_run``). An ``on_step`` metric logged at any other batch is overwritten before a logger sees
    it, yet ``LightningModule.log`` costs 0.6-0.9 ms of CPU a call: callbacks that log several figures
    per batch would otherwise take that from every step. A stop requested after the asking callback's hook
    (a later callback's) makes Lightning write the batch without that callback's figures of it; the
    strategies' time limit (:mod:`~lightning_partial.strategies.agreed_clock`) stops in the step, before.
    """
    try:
        if trainer.fit_loop._should_accumulate() and trainer.lightning_module.automatic_optimization:
            return False
        return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)
    except AttributeError:  # a Lightning that moved them: log every batch
        return True
