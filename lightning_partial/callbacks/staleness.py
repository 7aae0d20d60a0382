"""StalenessTracker: per-round statistics of a partial-collective strategy, logged per step.

Contract:

* Reads ``trainer.strategy.round_stats`` (optimizer index -> the latest
  :class:`~lightning_partial.collectives.RoundStats`, set by
  :class:`~lightning_partial.EagerSGDStrategy`) in ``on_train_batch_end``,
  after the batch's optimizer steps.
* Logs, for each optimizer whose round index advanced since the last batch
  end (so a batch that only accumulated gradients logs nothing twice):
  ``partial/fresh``, ``partial/staleness_mean``, ``partial/staleness_max``,
  ``partial/wait_ms``, ``partial/activator``, ``partial/contributions``,
  ``partial/discounted`` (the gradients' worth the staleness rule withheld
  from the round, over all ranks), ``partial/round``, ``partial/skipped`` (1
  where this rank skipped the batch's compute: eager-SGD's ``catch_up``); under ``abs_sgd`` also
  ``partial/step_lag``: how many optimizer steps late the latest step applied
  this rank's micro-batches (0: on the weights they were computed on; its own
  figure on each rank, a slow rank's the largest; see
  :mod:`~lightning_partial.strategies.step_lag`); with suffix ``_<i>`` for optimizer index ``i > 0``.
  Through ``pl_module.log(on_step=True, on_epoch=False, sync_dist=False)`` at the
  batches whose step metrics Lightning writes (``Trainer(log_every_n_steps=...)``),
  each metric's latest value since the last of them in the epoch: a call costs
  0.6-0.9 ms of CPU, and at other batches no logger would see it. So
  ``trainer.callback_metrics`` holds them as of the last written batch (never,
  with ``log_every_n_steps=0``: a ``ModelCheckpoint`` or ``EarlyStopping``
  monitoring one needs a written batch), and a stop requested after this
  callback's hook (a later callback's; ``max_time`` under these strategies
  stops in the step, before, but in pure ``mode="sync"``) writes its last batch without its figures; :attr:`last`
  and :attr:`summary` always hold every round. Any Lightning logger (CSV, TensorBoard,
  W&B) receives them (loggers write rank 0's view; only ``wait_ms``, ``skipped`` and
  ``step_lag`` differ between ranks); no collective.
  Note that Lightning hands loggers the latest value of every step metric at
  each logged step: under manual optimization, an optimizer that did not step
  on a batch shows its previous round again (``partial/round_<i>`` tells).
* At train start, logs the strategy's update rule as hyperparameters
  (``partial/weight_prediction``, ``partial/staleness_rule``: the rule resolved
  against the optimizer; ``abs_sgd``: ``partial/step_samples``, ``partial/step_boundary``, ``partial/delay``; ``wagma_sgd``, ``ds_sync``:
  ``partial/adaptive_scaling``; every strategy here: ``partial/final_sync``), from
  ``trainer.strategy.update_rule()``.
* Keeps a running :class:`StalenessSummary` per optimizer in :attr:`summary`,
  which also counts the final flush round (seen at ``on_fit_end``, where
  Lightning no longer accepts ``log``).
* A strategy without ``round_stats`` (``ddp``, ...): the tracker does nothing
  and says so once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_partial.callbacks.step_metrics import PendingStepMetrics
from lightning_partial.collectives import RoundStats

log = logging.getLogger(__name__)

METRICS = ("fresh", "staleness_mean", "staleness_max", "wait_ms", "activator", "contributions", "discounted", "round",
           "skipped")


def round_metrics(stats: RoundStats) -> dict[str, float]:
    """The logged figures of one round, by metric name (without prefix or suffix)."""
    return {
        "fresh": float(len(stats.fresh)),
        "staleness_mean": float(stats.mean_staleness),
        "staleness_max": float(stats.max_staleness),
        "wait_ms": stats.wait_time * 1e3,
        "activator": float(stats.activator),
        "contributions": float(stats.contributions),
        "discounted": stats.discounted_total,
        "round": float(stats.round_index),
        "skipped": float(stats.skipped),
    }


def metric_name(metric: str, index: int) -> str:
    """``partial/<metric>`` for optimizer 0, ``partial/<metric>_<index>`` for the others."""
    return f"partial/{metric}" if index == 0 else f"partial/{metric}_{index}"


@dataclass
class StalenessSummary:
    """Running totals of the rounds one optimizer's engine ran, as this rank saw them.

    Attributes:
        rounds: rounds seen (including a final flush, if the fit reached it).
        synchronous: how many of them were synchronous.
        fresh_total, contributions_total: sums of ``len(fresh)`` and ``contributions``.
        discounted_total: the gradients' worth withheld by the staleness rule, summed over rounds.
        staleness_max: the largest staleness of any contribution seen.
        staleness_mean_total: sum of the rounds' mean staleness (see :attr:`staleness_mean`).
        wait_ms_total: this rank's time blocked in the engine, in milliseconds.
        activators: rounds activated per rank (``-1``: synchronous rounds).
        last_round: the latest round index seen (``-1``: none yet).
        skipped: rounds whose batch this rank skipped (eager-SGD's ``catch_up``).
    """

    rounds: int = 0
    synchronous: int = 0
    fresh_total: int = 0
    contributions_total: int = 0
    discounted_total: float = 0.0
    staleness_max: int = 0
    staleness_mean_total: float = 0.0
    wait_ms_total: float = 0.0
    activators: Counter[int] = field(default_factory=Counter)
    last_round: int = -1
    skipped: int = 0

    def add(self, stats: RoundStats) -> None:
        """Counts one round."""
        self.rounds += 1
        self.synchronous += int(stats.synchronous)
        self.fresh_total += len(stats.fresh)
        self.contributions_total += stats.contributions
        self.discounted_total += stats.discounted_total
        self.staleness_max = max(self.staleness_max, stats.max_staleness)
        self.staleness_mean_total += stats.mean_staleness
        self.wait_ms_total += stats.wait_time * 1e3
        self.skipped += int(stats.skipped)
        self.activators[stats.activator] += 1
        self.last_round = stats.round_index

    @property
    def fresh_mean(self) -> float:
        """Mean number of fresh contributors per round."""
        return self.fresh_total / self.rounds if self.rounds else 0.0

    @property
    def staleness_mean(self) -> float:
        """Mean over rounds of the round's mean staleness."""
        return self.staleness_mean_total / self.rounds if self.rounds else 0.0

    @property
    def wait_ms_mean(self) -> float:
        """Mean time this rank waited per round, in milliseconds."""
        return self.wait_ms_total / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (activators keyed by rank as strings)."""
        return {
            "rounds": self.rounds,
            "synchronous": self.synchronous,
            "fresh_total": self.fresh_total,
            "fresh_mean": self.fresh_mean,
            "contributions_total": self.contributions_total,
            "discounted_total": self.discounted_total,
            "staleness_max": self.staleness_max,
            "staleness_mean": self.staleness_mean,
            "wait_ms_total": self.wait_ms_total,
            "wait_ms_mean": self.wait_ms_mean,
            "skipped": self.skipped,
            "activators": {str(k): v for k, v in sorted(self.activators.items())},
            "last_round": self.last_round,
        }


class StalenessTracker(Callback):
    """Logs each new round's freshness, staleness, wait and activator per step (see the module docstring).

    Args:
        log: log through ``pl_module.log`` (``False``: keep only :attr:`summary`).

    Attributes:
        summary: optimizer index -> :class:`StalenessSummary`.
        last: optimizer index -> the latest round's figures (as logged).
    """

    def __init__(self, *, log: bool = True) -> None:
        super().__init__()
        if not isinstance(log, bool):
            raise ValueError(f"StalenessTracker: log must be a bool, got {log!r}")
        # Not ``self.log``: Lightning sets every callback's ``log`` to the module's at fit start.
        self._log = log
        self.summary: dict[int, StalenessSummary] = {}
        self.last: dict[int, dict[str, float]] = {}
        self._pending = PendingStepMetrics(batch_size=1)
        self._warned = False

    def _round_stats(self, trainer: "pl.Trainer") -> Optional[Mapping[int, RoundStats]]:
        stats = getattr(trainer.strategy, "round_stats", None)
        if stats is None and not self._warned:
            self._warned = True
            if trainer.is_global_zero:
                log.warning(
                    "StalenessTracker: strategy %s has no round_stats (not a partial-collective strategy): "
                    "nothing will be logged",
                    type(trainer.strategy).__name__,
                )
        return stats

    def _new_rounds(self, trainer: "pl.Trainer") -> list[tuple[int, RoundStats]]:
        """The optimizers whose round advanced since the last call, with their latest stats; counts them."""
        stats_by_index = self._round_stats(trainer)
        if not stats_by_index:
            return []
        new = []
        for index, stats in sorted(stats_by_index.items()):
            summary = self.summary.setdefault(index, StalenessSummary())
            if stats.round_index <= summary.last_round:
                continue  # no optimizer step on this batch (accumulation), or already counted
            summary.add(stats)
            new.append((index, stats))
        return new

    @staticmethod
    def _figures(trainer: "pl.Trainer", index: int, stats: RoundStats) -> dict[str, float]:
        """The round's figures, and ``step_lag`` where the strategy measures one (``abs_sgd``)."""
        figures = round_metrics(stats)
        lags = getattr(trainer.strategy, "step_lags", None)
        lag = lags.last(index) if lags is not None else None
        if lag is not None:
            figures["step_lag"] = lag
        return figures

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            # Each fit counts its own rounds: a later fit (or a resumed one) starts from its own first round.
            self.summary.clear()
            self.last.clear()
            self._round_stats(trainer)  # warns at set-up rather than at the first batch

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # The update rule in force (weight prediction, the resolved staleness rule), once, as
        # hyperparameters: every logger (W&B's config, CSV's hparams.yaml) records it.
        self._pending.clear()
        rule = getattr(trainer.strategy, "update_rule", None)
        if self._log and callable(rule):
            hyperparameters = {f"partial/{key}": value for key, value in rule().items()}
            for logger in trainer.loggers:
                logger.log_hyperparams(hyperparameters)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        for index, stats in self._new_rounds(trainer):
            figures = self._figures(trainer, index, stats)
            self.last[index] = figures
            if self._log:
                self._pending.add({metric_name(metric, index): value for metric, value in figures.items()})
        self._pending.log(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._pending.clear()  # Lightning drops an epoch's unwritten step metrics: so do we

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # The strategy's final flush runs after the callbacks' on_train_end: count it here.
        for index, stats in self._new_rounds(trainer):
            self.last[index] = self._figures(trainer, index, stats)
