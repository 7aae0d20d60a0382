"""Lightning's decisions by the clock, agreed through the rounds instead of a collective per batch.

Three of Lightning's features act when time has passed, and each would make the
ranks disagree or synchronise every step under a strategy whose ranks reach a
batch at different times:

* ``Trainer(max_time=...)``: the ``Timer`` broadcasts rank 0's "time is up" at
  every batch end;
* ``ModelCheckpoint(train_time_interval=...)``: rank 0's "save now", broadcast
  at every batch end;
* ``Trainer(val_check_interval=<a time>)``: each rank validates when its *own*
  clock says so, with no agreement at all.

A broadcast per batch ties every rank to rank 0's pace (what the strategies
exist to avoid) and, under ``abs_sgd``, whose ranks run different numbers of
batches, pairs with another rank's unrelated collective. Here rank 0's clock
still decides, as under DDP, but its decision travels in the next round's header
(the engines' ``request_finish`` and ``announce``), so every rank acts on it at
the same round, with no collective of its own:

* the time limit ends every rank's fit after the step that applies the round
  (``abs_sgd``: that round becomes the final one, as at ``max_steps``); the end
  of fit then runs as at any end (the final round: nothing computed is lost);
* a time-based checkpoint is saved by every rank at the start of the batch after
  the one that applied the round, or at the end of fit if that comes first
  (the strategy's queue of saves, in round order: under ``abs_sgd`` a rank
  applies a round in its own batch, so the saves keep the rounds' order, step
  checkpoints included);
* a time-based validation runs on every rank at the end of the batch that applied
  the round (the strategies whose rounds are steps; ``abs_sgd`` validates at epoch
  ends only);
* under a time limit, the synchronous finish (``final_sync=f``) begins once ``1 - f``
  of ``max_time`` has passed: rank 0 asks every engine for it (``request_sync``), and
  every rank's rounds are synchronous from the same round on (the strategies whose
  rounds are steps; ``abs_sgd`` counts its finish in samples or rounds only). A limit
  of epochs or steps that comes first keeps its own finish. The same request starts it
  at a global step where the engines cannot place it themselves (several optimizers
  under manual optimization, bound by ``max_steps``).

Threads: everything here runs on each rank's main thread; the engines'
communication threads carry the bits. Pure ``sync`` mode keeps Lightning's own
handling (a synchronous step costs a broadcast nothing more).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_partial import _compat

#: The announcement bit of a time-based validation; checkpoint ``i`` (in ``trainer.checkpoint_callbacks``
#: order among those with a time interval) announces ``1 << (1 + i)``.
VALIDATE = 1
_MAX_TIME_CHECKPOINTS = 60  # the engine's ANNOUNCE_BITS, less the validation's bit


@dataclass
class TimeCheckpoint:
    """A ``ModelCheckpoint`` whose ``train_time_interval`` this fit took over."""

    callback: Any
    interval: float  # seconds
    bit: int
    announced: bool = False  # rank 0: announced, not yet saved


class AgreedClock:
    """One fit's clock decisions (see the module docstring); every rank builds one at train start.

    Args:
        rank: this rank (only rank 0 reads its clock).
        finish: asks every rank to end the fit (the engines' ``request_finish``).
        announce: has every rank see bits in the same round (an engine's ``announce``).
        lockstep: every rank applies round ``r`` in its step ``r``: a time-based validation
            can run at an agreed step, and a save can skip a step saved already (Lightning's
            check; under ``abs_sgd`` the ranks' global steps differ at a save).
        begin_finish: asks every rank for the synchronous finish (the engines' ``request_sync``);
            ``None``: the strategy places its finish by steps or samples only.
        final_sync: the fraction of ``max_time`` the synchronous finish takes, at its end.
        finish_at_step: the synchronous finish also begins at this global step (several optimizers
            under manual optimization and ``max_steps``, which counts all their steps: no engine
            knows in advance which of its rounds are the fit's last), or ``None``.
    """

    def __init__(self, *, rank: int, finish: Callable[[], None], announce: Callable[[int], None],
                 lockstep: bool, begin_finish: Optional[Callable[[], None]] = None,
                 final_sync: float = 0.0, finish_at_step: Optional[int] = None) -> None:
        self.rank = rank
        self._finish = finish
        self._announce = announce
        self._lockstep = lockstep
        self._begin_finish = begin_finish
        self._final_sync = final_sync
        # max_time's clock (training seconds elapsed) and when the synchronous finish begins; None: no such finish.
        self._elapsed: Optional[Callable[[], float]] = None
        self._finish_at: Optional[float] = None
        # The global step from which the synchronous finish begins, where the engines' rounds cannot place it.
        self._finish_at_step = finish_at_step if begin_finish is not None else None
        self.checkpoints: list[TimeCheckpoint] = []
        self._validation_interval: Optional[float] = None
        self._validation_announced = False
        self._validation_due = False

    # ------------------------------------------------------------- set-up
    def take_over(self, trainer: Any) -> None:
        """Every rank, main thread, at train start: the Timer, time-based checkpoints and validation.

        Under manual optimization Lightning saves by time never (its hook checks steps only), and so
        do these strategies.
        """
        _compat.take_over_step_timers(trainer, self._finish)
        budget = _compat.step_timer_budget(trainer)
        if budget is not None and self._begin_finish is not None and self._final_sync > 0:
            self._elapsed, duration = budget
            self._finish_at = (1.0 - self._final_sync) * duration
        if trainer.lightning_module.automatic_optimization:
            for callback in trainer.checkpoint_callbacks:
                if getattr(callback, "_train_time_interval", None) is None:
                    continue
                if len(self.checkpoints) == _MAX_TIME_CHECKPOINTS:
                    raise ValueError(f"at most {_MAX_TIME_CHECKPOINTS} ModelCheckpoint callbacks with a "
                                     "train_time_interval per fit")
                interval = _compat.take_over_time_checkpoint(callback)
                assert interval is not None
                self.checkpoints.append(TimeCheckpoint(callback, interval, 1 << (1 + len(self.checkpoints))))
        if self._lockstep and _compat.take_over_time_validation(trainer, self._take_validation):
            self._validation_interval = _compat.time_validation_interval(trainer)

    def restore(self, trainer: Any) -> None:
        """Every rank, main thread, at the end of fit (or teardown): Lightning's own handling back."""
        _compat.restore_step_timers(trainer)
        for checkpoint in self.checkpoints:
            _compat.restore_checkpoint_triggers(checkpoint.callback)
        self.checkpoints.clear()
        _compat.restore_time_validation(trainer)
        self._validation_interval = None

    # ------------------------------------------------------------ per batch
    def at_batch_start(self, trainer: Any) -> None:
        """Rank 0, main thread: announces what its clock says is due (others: nothing)."""
        if self.rank != 0:
            return
        # Not while min_steps / min_epochs keep the fit going past its time limit (as the Timer's own stop).
        by_time = (self._finish_at is not None and self._elapsed is not None and self._elapsed() >= self._finish_at
                   and _compat.can_stop_early(trainer))
        if by_time or (self._finish_at_step is not None and trainer.global_step >= self._finish_at_step):
            self._finish_at = self._finish_at_step = None  # once per fit
            assert self._begin_finish is not None
            self._begin_finish()
        now = time.monotonic()
        bits = 0
        for checkpoint in self.checkpoints:
            if not checkpoint.announced and _compat.time_since_checkpoint(checkpoint.callback, now) >= checkpoint.interval:
                checkpoint.announced = True
                bits |= checkpoint.bit
        interval = self._validation_interval
        if interval is not None and not self._validation_announced and \
                _compat.time_since_validation(trainer, now) >= interval:
            self._validation_announced = True
            bits |= VALIDATE
        if bits:
            self._announce(bits)

    def record(self, announced: int) -> list[TimeCheckpoint]:
        """Every rank, main thread, per round applied (of the engine that carries the announcements): the
        time-based saves it calls for (the caller queues them); a validation it calls for is noted."""
        if announced & VALIDATE and self._validation_interval is not None:
            self._validation_due = True
        return [checkpoint for checkpoint in self.checkpoints if announced & checkpoint.bit]

    def save(self, trainer: Any, checkpoint: TimeCheckpoint) -> None:
        """Every rank, main thread, where the strategy's queue of saves reaches it: the time-based save."""
        checkpoint.announced = False
        _compat.save_time_checkpoint(checkpoint.callback, trainer, time.monotonic(), skip_same_step=self._lockstep)

    def _take_validation(self) -> bool:
        """The epoch loop's question at a batch end: whether an applied round called for a validation."""
        if not self._validation_due:
            return False
        self._validation_due = False
        self._validation_announced = False
        return True
