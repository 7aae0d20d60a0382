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
* End of fit (main thread): ``flush()`` runs the final synchronous round on
  every engine; its result (carried gradients) is applied with one more
  optimizer step, so nothing computed is lost and all replicas end identical.
* Checkpoints carry each engine's round counter, initiator RNG and pending
  carried gradients, so no computed gradient is lost across a resume.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import Unpack, override

import lightning.pytorch as pl
from lightning_partial import _compat
from lightning_partial.collectives import PartialAllreduce, PartialAllreduceConfig, RoundResult, RoundStats
from lightning_partial.strategies import compensation
from lightning_partial.strategies.options import StrategyOptions
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
            **Decision:** ``max_staleness`` defaults to 2 here (the engine's
            default is unbounded, as the paper's solo). Unbounded, a straggler
            falls many rounds behind and its gradients, applied that stale
            under momentum, cost accuracy; the bound keeps them recent, at the
            price of the fast ranks waiting for a rank more than 2 rounds
            behind. Measured in ``docs/algorithms.md#bounded-staleness``.
            ``max_staleness=None`` restores the paper's unbounded rule.
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
        find_unused_parameters: parameters that no contribution of a round used
            keep ``grad = None`` (untouched by the optimizer, as under DDP with the
            option of that name); costs one element per parameter in every round
            and, on CUDA, a host synchronisation in rounds this rank's fresh
            gradient missed. ``False`` (default): a missing gradient counts as zeros.
        timeout, collective_timeout: see :class:`~lightning_partial.strategies.partial.PartialStrategy`.
        process_group_backend: default ``"nccl"`` on CUDA, ``"gloo"`` otherwise.
        start_method: ``"popen"`` (scripts, torchrun, SLURM) or ``"spawn"``.

    The strategy object holds no thread and no group until ``setup``: it can be
    pickled (``"eager_sgd_spawn"``).
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
        max_staleness: Optional[int] = 2,
        staleness_rule: str = "auto",
        weight_prediction: bool = True,
        find_unused_parameters: bool = False,
        seed: int = 0,
        **kwargs: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(**kwargs)
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
        if not isinstance(find_unused_parameters, bool):
            raise ValueError(f"find_unused_parameters must be a bool, got {find_unused_parameters!r}")
        self.find_unused_parameters = find_unused_parameters
        self._set_weight_prediction(weight_prediction)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        # After the optimizers exist, before any rank trains: a rule the optimizer
        # cannot serve fails here.
        self._staleness = compensation.resolve_all(self.staleness_rule, self.optimizers, owner=self.strategy_name)

    @override
    def _prediction_in_force(self) -> Optional[WeightPrediction]:
        # mode="sync", and one rank whose rounds hold only its own gradient: no gradient is ever late, so
        # none is predicted; the steps stay DDP's (on one device strategy="auto"'s, bit for bit).
        if self.synchronous or self.world_size == 1:
            return None
        return self._prediction

    @override
    def _build_engine(self, index: int, params: list[torch.nn.Parameter], store: dist.Store) -> PartialAllreduce:
        return PartialAllreduce(
            # Resolved in setup(), which every fit runs before on_train_start builds the engines.
            replace(self.partial_config, name=f"eager_sgd-{index}", staleness=self._staleness[index]),
            store=store,
            rank=self.global_rank,
            world_size=self.world_size,
            like=[*params, self._presence(params, [True] * len(params))] if self.find_unused_parameters else params,
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

        def closure_then_sync() -> Any:
            predicted = nullcontext() if prediction is None or before is None else prediction.predicted(
                index, params, before)
            with predicted:
                result = closure()
            self._synchronise(index)
            return result

        output = self._lightning_step(optimizer, closure_then_sync, model, kwargs)
        if prediction is not None and before is not None:
            prediction.finish(index, params, before)
        return output

    @staticmethod
    def _presence(params: list[torch.nn.Parameter], present: list[bool]) -> torch.Tensor:
        """1 per parameter with a gradient, in the first parameter's dtype and device (its buffer)."""
        return torch.tensor(present, dtype=params[0].dtype).to(params[0].device, non_blocking=True)

    def _synchronise(self, index: int) -> None:
        params = self._params[index]
        present = [p.grad is not None for p in params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        extra = [self._presence(params, present)] if self.find_unused_parameters else []
        result = self._engines[index].arrive([*grads, *extra])
        # This rank's fresh gradient with every parameter's in the round: every parameter is
        # used, on every rank alike (the header says so to all), without reading the sums.
        self._set_gradients(params, result, known_used=all(present) and self.global_rank in result.stats.fresh)
        result.release()
        self._record(index, result.stats)

    def _set_gradients(self, params: list[torch.nn.Parameter], result: RoundResult, *, known_used: bool) -> None:
        """The round's gradients into ``p.grad``; with ``find_unused_parameters``, ``None`` for a parameter
        no contribution of the round used.

        ``known_used``: every parameter is known to be used (the presence sums are not read).
        """
        values = result.tensors
        used = [True] * len(params)
        if self.find_unused_parameters:
            *values, presence = values
            if not known_used:
                used = presence.gt(0).tolist()
        for p, g, u in zip(params, values, used):
            if not u:
                p.grad = None  # globally unused in this round: untouched, as under DDP
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    @override
    def _final_round(self, index: int, engine: PartialAllreduce) -> RoundStats:
        """The final flush; its result (carried gradients) is applied with one more optimizer step.

        That step goes through what every step goes through: the
        ``on_before_optimizer_step`` hooks and gradient clipping
        (``_compat.before_optimizer_step``). It runs in ``on_train_end``, after
        the fit loop's last logging: a value ``self.log``-ged from those hooks
        for this step reaches no logger.
        """
        result = engine.flush()
        if result.stats.contributions:
            optimizer = self.optimizers[index]
            for p in self._params[index]:
                p.grad = None
            self._set_gradients(self._params[index], result, known_used=False)
            _compat.before_optimizer_step(self.precision_plugin, self.lightning_module, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        result.release()
        return result.stats
