"""EagerSGDStrategy: data-parallel training over the partial-allreduce engine.

Contract (threads and collectives): see :mod:`lightning_partial.strategies.partial`
for set-up, SIGTERM, checkpoints and the end of fit, common to every strategy.
Specific to eager-SGD:

* Each optimizer step (main thread): after the closure's backward and before
  gradient clipping and ``optimizer.step``, the gradients of the optimizer's
  parameters are handed to the engine (``arrive``); the round's result replaces
  them. The engine's communication thread issues the round's allreduces.
* Unused parameters (``find_unused_parameters=True``, as DDP's option of that
  name): beside the gradients, each rank contributes one more small tensor,
  1 per parameter whose gradient it has (``None`` is sent as zeros). Its round
  sum is positive exactly for the parameters that some contribution of the
  round used; the others get ``grad = None``, so that the optimizer leaves
  them alone (no momentum, no weight decay), as DDP does with globally unused
  parameters. It rides in the round's first buffer. It is read on the host
  (a synchronisation on CUDA) unless this rank's own fresh gradient, with
  every parameter's, is in the round, which makes every parameter used.
  Without the option (default) a missing gradient is sent and applied as
  zeros.
* With ``overlap=True`` (main thread): the step hands its gradient over with
  ``submit`` (no wait) and applies the previous step's round (``collect``), whose
  collectives ran on the communication thread while this step computed. A
  checkpoint first takes the round in flight (``InFlight.settle``), so the cut
  stays consistent, and saves its result for the next step.
* With ``catch_up=True`` (main thread): before the closure, a rank whose engine is
  ``behind`` (this step's round was taken without it) does not run the closure; it
  calls ``skip()`` (an arrival without a gradient) and applies the round's result
  through the same step, hooks and clipping. Lightning sees a ``training_step`` that
  returned ``None``.
* End of fit (main thread): ``flush()`` runs the final synchronous round on
  every engine; its result (carried gradients) is applied with one more
  optimizer step, so nothing computed is lost (but the share of a late gradient that the staleness rule
  withholds, counted as ``discounted``) and all replicas end identical.
* Checkpoints carry each engine's round counter, initiator RNG and pending
  carried gradients, so no computed gradient is lost across a resume.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import Unpack, override

import lightning.pytorch as pl
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from lightning_partial import _compat
from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig, RoundResult, RoundStats
from lightning_partial.collectives.staleness import StalenessWeights
from lightning_partial.strategies import compensation
from lightning_partial.strategies.options import StrategyOptions
from lightning_partial.strategies.checkpoint import IN_FLIGHT_KEY, CheckpointMismatchError
from lightning_partial.strategies.overlap import InFlight
from lightning_partial.strategies.fit_state import FitState
from lightning_partial.strategies.partial import ConfiguredStrategy, StepModel
from lightning_partial.strategies.prediction import WeightPrediction

log = logging.getLogger(__name__)


class EagerSGDStrategy(ConfiguredStrategy[PartialAllreduce]):
    """Eager-SGD: gradients averaged by partial allreduce (solo, majority, quorum, sync).

    Args:
        mode, quorum, backup_workers, late, normalize, sync_every, max_staleness, seed:
            the engine's :class:`~lightning_partial.collectives.PartialAllreduceConfig`
            (validated here; the checks that need the world size run at set-up).
            ``mode="quorum", backup_workers=b``: a round waits for all ranks but
            the last ``b`` to arrive (``"eager_sgd_backup"``: ``b = 1``); under
            momentum this keeps most of each round fresh where solo's is mostly
            one round late (``docs/staleness.md#why-these-defaults``).
            **Decision:** ``max_staleness`` defaults to 1 here (the engine's
            default is unbounded, as the paper's solo). Unbounded, a straggler
            falls many rounds behind and its gradients, applied that stale
            under momentum, cost accuracy; the bound keeps them recent, at the
            price of the fast ranks waiting for a rank more than 1 round
            behind. A bound of 2 is about 8-10% faster and ended 1.8 points
            below DDP in the main job over ten seeds, against -0.2 at 1
            (``docs/staleness.md#the-staleness-bound``). ``max_staleness=2``
            for throughput first; ``None`` restores the paper's unbounded rule.
        staleness_rule: how much of a carried (late) gradient enters its round:
            ``"auto"`` (default): ``"inverse"`` when the optimizer has momentum
            (SGD ``momentum``, Adam ``beta1``), else ``"none"``; ``"momentum"``:
            weight ``mu ** tau`` for a gradient ``tau`` rounds late, the share the
            momentum buffer would still hold had it arrived on time (refused for an
            optimizer without momentum); ``"inverse"``: ``1 / (1 + tau)``;
            ``"none"``: the paper's rule, every gradient whole. What a weight
            withholds is counted per round (``RoundStats.discounted``,
            ``partial/discounted``). See :mod:`lightning_partial.collectives.staleness`.
        weight_prediction: ``True`` (default): each step's gradient is computed at
            the current weights plus the last step's update (linear weight
            prediction), the weights restored exactly afterwards. A gradient that
            misses its round is applied one update later, at about the weights it
            was computed at; one that makes its round is a look-ahead gradient,
            as Nesterov's. **Decision:** on by default: under momentum it
            recovers most of the accuracy that late gradients cost, in every
            mode (measured in ``docs/staleness.md``). Costs two parameter-sized buffers and two
            copies of the weights per step. ``False``: gradients of the current
            weights (the paper's rule). Never in ``mode="sync"`` or at world size 1
            (nothing is late: the steps stay DDP's, and ``strategy="auto"``'s). The mechanism is
            :mod:`~lightning_partial.strategies.prediction`'s, shared with ``abs_sgd``.
        overlap: ``False`` (default): a step waits for its own round after backward (the
            paper's rule). ``True``: step ``r`` submits its gradient to round ``r`` and applies
            round ``r - 1``'s result, whose collectives ran while step ``r`` computed: the
            round leaves the step's critical path, and every result is applied one step
            after it was computed (weight prediction, when on, computes each gradient at
            the weights it is applied to; under ``staleness_rule="auto"`` or ``"momentum"``
            with SGD momentum, Adam or AdamW that step is re-timed as ``abs_sgd``'s: spike
            compensation). A fit's first step then applies nothing; the last round is
            applied at the end of fit, before the flush. Off by default: it buys
            throughput where a round's latency is exposed (many cores per rank, GPUs), at
            some accuracy under momentum (measured in ``docs/staleness.md``). See
            :mod:`~lightning_partial.strategies.overlap` and ``docs/staleness.md#overlapped-rounds``.
        catch_up: ``False`` (default): a rank computes every batch's gradient, however far
            behind (up to ``max_staleness``). ``True``: a rank whose next step's round has
            already run without it (:attr:`PartialAllreduce.behind
            <lightning_partial.collectives.PartialAllreduce.behind>`) skips that batch: no
            ``training_step``, no backward; it applies the round's result as every rank does
            (``PartialAllreduce.skip``) and so catches up instead of computing a gradient that
            would arrive late. Nothing computed is lost: the skipped batch's samples are not
            trained (counted in :attr:`skipped_steps`, ``RoundStats.skipped``,
            ``partial/skipped``), so an epoch trains fewer samples in fewer seconds. A
            straggler's lag then stays within one straggle instead of accumulating, and a
            bound above the straggle (``max_staleness=3`` for a delay of two steps) no longer
            makes the fast ranks wait (``docs/staleness.md#catching-up``). Needs automatic
            optimization with ``accumulate_grad_batches=1``; not with ``overlap`` or
            ``mode="sync"``. Steps whose round is synchronous (``final_sync``, ``sync_every``)
            are always computed. A skipped batch runs no ``training_step``: a collective issued
            there (``self.log(..., sync_dist=True)``, ``all_gather``) is then not issued on that
            rank, and the ranks' later collectives pair up wrongly until ``timeout`` ends the
            fit; use ``catch_up`` with a ``training_step`` that issues none (plain ``self.log``
            is fine). Under a ``LightningModule.optimizer_step`` override that wraps the
            closure, nothing is skipped (a warning says so once).
        find_unused_parameters: parameters that no contribution of a round used
            keep ``grad = None`` (untouched by the optimizer, as under DDP with the
            option of that name); costs one element per parameter in every round
            and, on CUDA, a host synchronisation in rounds this rank's fresh
            gradient missed. ``False`` (default): a missing gradient counts as zeros.
        final_sync: the fraction of the fit's optimizer steps, at its end, whose rounds are
            fully synchronous (every rank's fresh gradient, and whatever is still carried in
            the first of them): the fit ends on DDP's steps from where the fast rounds left it
            (:mod:`~lightning_partial.strategies.final_sync`; placed against
            ``trainer.estimated_stepping_batches``, or begun by rank 0's clock once ``1 - final_sync``
            of ``max_time`` has passed, whichever comes first). **Decision:** ``0.05`` (default): under
            AdamW at a constant rate solo ended 3.4-8.6 points below DDP without it and
            0.0-0.9 with it (three seeds); it costs the straggler's wait in those rounds only
            (``docs/staleness.md#the-synchronous-finish``). ``0.0``: every round as ``mode``
            says (the paper's rule).
        timeout, collective_timeout: see :class:`~lightning_partial.strategies.partial.PartialStrategy`.
        process_group_backend: default ``"nccl"`` on CUDA, ``"gloo"`` otherwise.
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"`` or ``"fork"``.

    The strategy object holds no thread and no group until ``setup``: it can be
    pickled (``"eager_sgd_spawn"``); a forked rank inherits none (``"eager_sgd_fork"``).
    """

    strategy_name = "eager_sgd"
    registry_entries = (
        ("eager_sgd", "eager-SGD with partial allreduce, mode 'solo'", {"mode": "solo"}),
        ("eager_sgd_majority", "eager-SGD with partial allreduce, mode 'majority'", {"mode": "majority"}),
        ("eager_sgd_backup", "eager-SGD with partial allreduce, mode 'quorum', backup_workers=1",
         {"mode": "quorum", "backup_workers": 1}),
    )

    def __init__(
        self,
        *,
        mode: str = "solo",
        quorum: Optional[int] = None,
        backup_workers: Optional[int] = None,
        late: str = "carry",
        normalize: str = "world",
        sync_every: Optional[int] = None,
        max_staleness: Optional[int] = 1,
        staleness_rule: str = "auto",
        weight_prediction: bool = True,
        overlap: bool = False,
        catch_up: bool = False,
        find_unused_parameters: bool = False,
        final_sync: float = 0.05,
        seed: int = 0,
        **kwargs: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**kwargs)
        self._set_final_sync(final_sync)
        self.partial_config = PartialAllreduceConfig(
            mode=mode,  # type: ignore[arg-type]
            quorum=quorum,
            backup_workers=backup_workers,
            late=late,  # type: ignore[arg-type]
            normalize=normalize,  # type: ignore[arg-type]
            sync_every=sync_every,
            max_staleness=max_staleness,
            seed=seed,
            timeout=self._timeout,
            collective_timeout=self._collective_timeout,
            name="eager_sgd",
        )
        self.staleness_rule = compensation.check_rule(staleness_rule, owner=self.strategy_name)
        self._set_find_unused_parameters(find_unused_parameters)
        if not isinstance(overlap, bool):
            raise ValueError(f"eager_sgd: overlap must be a bool, got {overlap!r}")
        if overlap and mode == "sync":
            # mode="sync" keeps Lightning's per-batch collectives (and SyncBatchNorm) on the default group,
            # safe on NCCL only because each step waits for its round before the next batch.
            raise ValueError(
                "eager_sgd: overlap=True is not available with mode='sync' (its steps must wait for their round: "
                "the default group's per-batch collectives share the NCCL communicator); use mode='solo', "
                "'majority' or 'quorum'"
            )
        self.overlap = overlap
        if not isinstance(catch_up, bool):
            raise ValueError(f"eager_sgd: catch_up must be a bool, got {catch_up!r}")
        if catch_up and (overlap or mode == "sync"):
            raise ValueError(
                "eager_sgd: catch_up=True skips a batch whose round ran without this rank, which needs rounds that "
                f"run without it (not mode='sync') and a step that waits for its own round (not overlap=True); got "
                f"mode={mode!r}, overlap={overlap!r}"
            )
        self.catch_up = catch_up
        #: Batches this rank skipped in the current fit (``catch_up``): their samples were not trained.
        self.skipped_steps = 0
        self._warned_unskippable = False
        #: Optimizer steps of the current fit whose gradient came computed before the step (manual optimization's
        #: ``manual_backward`` then ``opt.step()``): at the current weights, which weight prediction cannot move.
        self.unpredicted_steps = 0
        # Created here (no thread, no group: picklable); reset at every train start.
        self._in_flight: Optional[InFlight] = InFlight(extra=int(find_unused_parameters)) if overlap else None
        # With overlap, per optimizer: the re-timing of the step's delay (resolved at set-up), and the
        # delay of the result this step feeds the optimizer (0: on time, after a step that applied nothing).
        self._retiming: dict[int, StalenessWeights] = {}
        self._step_delay: dict[int, int] = {}
        self._set_weight_prediction(weight_prediction)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if self.catch_up and trainer.state.fn == TrainerFn.FITTING:
            assert self.lightning_module is not None
            if not self.lightning_module.automatic_optimization:
                raise ValueError("eager_sgd: catch_up=True needs automatic optimization (it skips a batch's "
                                 "training_step, which manual optimization runs itself)")
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"eager_sgd: catch_up=True skips whole batches: Trainer(accumulate_grad_batches="
                    f"{trainer.accumulate_grad_batches}) must be 1 (a skip would drop the micro-batches accumulated)"
                )
        if trainer.state.fn == TrainerFn.FITTING:
            self.skipped_steps = 0  # per fit (not restored by a resume); validate/test leave it as the fit left it
            self.unpredicted_steps = 0
        # After the optimizers exist, before any rank trains: a rule the optimizer
        # cannot serve fails here.
        self._staleness = compensation.resolve_all(self.staleness_rule, self.optimizers, owner=self.strategy_name)
        # Overlap applies every result one step late, as abs_sgd does: under "auto" and "momentum" that
        # step is re-timed as abs_sgd's are (spike compensation: SGD momentum, Adam, AdamW).
        self._retiming = {}
        if self.overlap and self.staleness_rule in ("auto", "momentum"):
            self._retiming = compensation.resolve_all(self.staleness_rule, self.optimizers,
                                                      owner=self.strategy_name, spike=True)

    @override
    def _prediction_in_force(self) -> Optional[WeightPrediction]:
        # mode="sync", and one rank whose rounds hold only its own gradient: no gradient is ever late, so
        # none is predicted; the steps stay DDP's (on one device strategy="auto"'s, bit for bit).
        # With overlap every gradient is applied a step late, at any world size.
        if not self.overlap and (self.synchronous or self.world_size == 1):
            return None
        return self._prediction

    @override
    def _fit_states(self) -> list[FitState]:
        states = super()._fit_states()
        return states + [self._in_flight] if self._in_flight is not None else states

    @override
    def update_rule(self) -> dict[str, Any]:
        """:meth:`PartialStrategy.update_rule`, ``overlap`` and ``catch_up`` (bools) and, with ``overlap``, ``overlap_retiming``: the rule
        that re-times each step's one-step delay, per optimizer, comma-separated (``"none"``: not re-timed)."""
        settings = {**super().update_rule(), "overlap": self.overlap, "catch_up": self.catch_up}
        if self.overlap:
            settings["overlap_retiming"] = ",".join(
                self._retiming.get(i, StalenessWeights()).rule for i in range(len(self.optimizers)))
        return settings

    @override
    def _build_engine(self, index: int, params: list[torch.nn.Parameter], store: dist.Store) -> PartialAllreduce:
        return PartialAllreduce(
            # Resolved in setup(), which every fit runs before on_train_start builds the engines.
            self._round_config(index, name=f"eager_sgd-{index}", staleness=self._staleness[index]),
            store=store,
            rank=self.global_rank,
            world_size=self.world_size,
            like=self._with_presence(params, params),
        )

    # ------------------------------------------------------------- training
    @override
    def _engine_step(self, index: int, optimizer: Optimizer, closure: Callable[[], Any], model: StepModel,
                     kwargs: dict[str, Any]) -> Any:
        """Runs the closure (at the predicted weights), synchronises the gradients, then clipping and the step."""
        prediction = self._prediction_in_force()
        params = self._params[index]
        # Weight prediction: the gradient is computed at the weights plus the last step's update,
        # where it is applied if it misses its round (most gradients in solo mode), then the
        # weights are restored exactly. The copy taken here becomes this step's update.
        before = prediction.begin(index, params) if prediction is not None else None
        if prediction is not None and _compat.computes_nothing(closure):
            self._note_unpredicted()

        def closure_then_sync() -> Any:
            predicted = nullcontext() if prediction is None or before is None else prediction.predicted(
                index, params, before)
            with predicted:
                result = closure()
            self._synchronise(index)
            return result

        def skip_then_sync() -> None:
            # This step's round ran without this rank: its result is applied as every rank's,
            # and the batch is never computed (Lightning sees a training_step that returned None).
            _compat.skip_closure(closure)
            self._synchronise(index, skip=True)
            self.skipped_steps += 1

        skipping = self.catch_up and self._engines[index].behind and self._can_skip(closure)
        output = self._lightning_step(optimizer, skip_then_sync if skipping else closure_then_sync, model, kwargs)
        self._compensate_delay(index)  # overlap's re-timing; a no-op for every other step, a skipped one included
        if prediction is not None and before is not None:
            prediction.finish(index, params, before)  # the step's update, spike included
        return output

    def _note_unpredicted(self) -> None:
        """Weight prediction in force, but the step's gradient was computed before the step (``opt.step()``
        without a closure): counted, and said once per fit."""
        if not self.unpredicted_steps:
            log.warning("rank %d: eager_sgd weight_prediction=True: the optimizer step's gradient was computed "
                        "before the step (manual_backward, then opt.step()), at the current weights, not at the "
                        "predicted ones. Pass the forward and backward as opt.step(closure=...) for prediction to "
                        "apply, or weight_prediction=False", self.global_rank)
        self.unpredicted_steps += 1

    def _can_skip(self, closure: Callable[[], Any]) -> bool:
        """``catch_up``: whether this step may skip its closure. Not while batches accumulate (a
        ``GradientAccumulationScheduler`` raises ``accumulate_grad_batches`` after set-up: a skip would
        overwrite the accumulated gradients), nor under a closure Lightning's loop cannot be told about."""
        if self._trainer.accumulate_grad_batches != 1:
            return False
        if _compat.skippable_closure(closure):
            return True
        if not self._warned_unskippable:
            self._warned_unskippable = True
            log.warning("rank %d: eager_sgd catch_up=True: the optimizer step's closure is not Lightning's (a "
                        "LightningModule.optimizer_step override wraps it), so this rank computes the batches it "
                        "would skip", self.global_rank)
        return False

    def _weigh_delayed(self, index: int, delay: int) -> None:
        """Overlap, after a landed result is in ``p.grad``, before clipping: its weight for its delay.

        ``delay``: the optimizer updates since its fresh gradients were computed (``Landed.delay``): 1, or
        0 where the step between applied nothing (a fit's first step), which leaves it on time.
        """
        weights = self._retiming.get(index)
        if weights is None or not weights.active:
            return
        optimizer, params = self.optimizers[index], self._params[index]
        weight = compensation.gradient_weight(optimizer, weights, delay)
        if weight != 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], weight)
        self._step_delay[index] = delay

    def _compensate_delay(self, index: int) -> None:
        """Overlap, after ``optimizer.step()``: the spike compensation of the step's delay (from ``p.grad`` as
        clipped), as abs_sgd's (:func:`~lightning_partial.strategies.compensation.compensate`)."""
        delay = self._step_delay.pop(index, 0)
        weights = self._retiming.get(index)
        if delay and weights is not None:
            compensation.compensate_step(self.optimizers[index], weights, self._params[index], delay)

    def _synchronise(self, index: int, *, skip: bool = False) -> None:
        """Main thread, after the closure's backward: the step's gradient to its round, a round's result into
        ``p.grad`` (this step's round; with ``overlap`` the previous step's, or none at a fit's first step).

        ``skip`` (``catch_up``, the closure not run): no gradient; this step's round's result into ``p.grad``.
        """
        params = self._params[index]
        engine = self._engines[index]
        if skip:
            self._apply_round(index, engine.skip(), known_used=False)
            return
        present = [p.grad is not None for p in params]
        grads = self._with_presence([p.grad if p.grad is not None else torch.zeros_like(p) for p in params], params,
                                    present)
        if self._in_flight is None:
            result = engine.arrive(grads)
            # This rank's fresh gradient with every parameter's in the round: every parameter is
            # used, on every rank alike (the header says so to all), without reading the sums.
            self._apply_round(index, result, known_used=all(present) and self.global_rank in result.stats.fresh)
            return
        if engine.stopped:
            # A checkpoint's save took the earlier round (InFlight.settle) and it carried a stop: no round
            # follows it on any rank. That round is applied now, as it would have been, and the stop recorded;
            # this step's gradient, which would have waited in the send buffer of a round that never runs, is
            # dropped (a stop applies nothing after its round: docs/algorithms.md).
            landed = self._in_flight.take(index, self.global_rank)
        else:
            # Submitted before the earlier round is collected: this round's collectives may start
            # (another rank's arrival may activate it) while this rank waits for, and applies, that one.
            round_index = engine.submit(grads)
            landed = self._in_flight.take(index, self.global_rank)
            self._in_flight.submitted(index, engine, round_index, all_present=all(present))
        # The step's own gradient is in the engine's send buffer (a copy): p.grad takes the landed round's.
        if landed is None:
            for p in params:
                p.grad = None  # a fit's first step: no round is complete yet, the optimizer sees no gradient
            return
        self._set_gradients(params, landed.tensors, known_used=landed.known_used)
        landed.release()
        self._weigh_delayed(index, landed.delay)
        if landed.result is not None:
            self._record(index, landed.result.stats)

    def _apply_round(self, index: int, result: RoundResult, *, known_used: bool) -> None:
        """This step's round's result into ``p.grad`` (:meth:`_set_gradients`), its buffer released, its stats
        recorded."""
        self._set_gradients(self._params[index], result.tensors, known_used=known_used)
        result.release()
        self._record(index, result.stats)

    @override
    def _final_round(self, index: int, engine: PartialAllreduce) -> RoundStats:
        """The final flush; its result (carried gradients) is applied with one more optimizer step.

        That step goes through what every step goes through: the
        ``on_before_optimizer_step`` hooks and gradient clipping
        (``_compat.before_optimizer_step``). It runs in ``on_train_end``, after
        the fit loop's last logging: a value ``self.log``-ged from those hooks
        for this step reaches no logger.
        """
        if self._in_flight is not None:
            # Overlap: the last step's round, not applied yet, gets its own step first.
            landed = self._in_flight.take(index, self.global_rank)
            if landed is not None:
                self._extra_step(index, landed.tensors, delay=landed.delay)
                landed.release()
                if landed.result is not None:
                    self._record(index, landed.result.stats)
                    if landed.result.stats.stop:
                        # That round carried a stop request: every rank's engine ended after it (the same
                        # round everywhere), so there is no flush; what is pending stays in the engine's state.
                        return landed.result.stats
        result = engine.flush()
        if result.stats.contributions:
            self._extra_step(index, result.tensors)
        result.release()
        return result.stats

    def _extra_step(self, index: int, values: list[torch.Tensor], *, delay: Optional[int] = None) -> None:
        """An optimizer step after the fit loop, through the hooks and clipping every step goes through.

        ``delay``: the overlap's last landed round (``Landed.delay``), re-timed as every step's.
        """
        optimizer = self.optimizers[index]
        for p in self._params[index]:
            p.grad = None
        self._set_gradients(self._params[index], values, known_used=False)
        if delay is not None:
            self._weigh_delayed(index, delay)
        _compat.before_optimizer_step(self.precision_plugin, self.lightning_module, optimizer)
        optimizer.step()
        self._compensate_delay(index)
        optimizer.zero_grad()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """:meth:`PartialStrategy.load_checkpoint`; without ``overlap``, refuses (when fitting) a checkpoint that
        holds a round result not yet applied (saved with ``overlap=True``): it would be lost."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = self._attached_trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if fitting and not self.overlap and checkpoint.get(IN_FLIGHT_KEY):
            raise CheckpointMismatchError(
                "the checkpoint was saved with overlap=True and holds a round's result not yet applied, which "
                "this strategy (overlap=False) would lose: resume with EagerSGDStrategy(overlap=True), or drop "
                "it explicitly with lightning_partial.strategies.checkpoint.drop_engine_state(src, dst)",
                source=checkpoint_path,
            )
        return checkpoint

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """With ``overlap``: the round in flight is taken first (every rank, before the engines' states are
        gathered), so that the cut is consistent; its result is saved and applied by the next step."""
        if self._in_flight is not None:
            self._in_flight.settle(self.global_rank)
        super().save_checkpoint(checkpoint, filepath, storage_options)
