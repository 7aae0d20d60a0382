"""Engine state in Lightning checkpoints: gathered from every rank on save, split again on resume.

Why a gather: only rank 0 writes the checkpoint file, but pending (carried)
gradients are per rank. ``Trainer.save_checkpoint`` runs on every rank at the
same step, so the strategy's ``save_checkpoint`` gathers each rank's engine
state to rank 0 with one ``gather_object`` on the strategy's collective group (once per
checkpoint, never per step).

Why the cut is consistent: every rank saves right after its optimizer step
``q - 1``, so its ``arrive`` for round ``q - 1`` has returned, which needs every
rank's communication thread to have completed round ``q - 1``. No rank arrives at
round ``q`` before the barrier that follows the save, so no round ``>= q`` is
active anywhere: the saved pending gradients are exactly those that no applied
round contains.

Checkpoint layout (under ``checkpoint[CHECKPOINT_KEY]``)::

    {"strategy": "eager_sgd", "family": "gradients", "world_size": P,
     "engines": {optimizer_index: [state of rank 0, ..., state of rank P-1]}}

where a state is :meth:`PartialAllreduce.state_dict`. ``family`` says what the
engines exchange (``"gradients"``: eager-SGD; ``"models"``: WAGMA-SGD and
DS-Sync): a resume under a strategy of another family ignores the entry
(:func:`resume_entry`), since one family's pending tensors mean nothing to the other.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch.distributed as dist

from lightning_partial.collectives import PartialCollectiveError

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_partial"


def gather_engine_states(
    states: dict[int, dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    strategy: str,
    family: str,
    group: Optional[Any] = None,
) -> Optional[dict[str, Any]]:
    """Collective on ``group`` (default: the default group): returns the checkpoint entry on rank 0, ``None`` elsewhere."""
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    if world_size > 1:
        try:  # bounded by the group's timeout (the strategy's ``timeout``)
            dist.gather_object(states, gathered, dst=0, group=group)
        except Exception as err:  # a dead or stalled rank: say which rank and which round
            step = next((int(s["step"]) for s in states.values()), None)
            raise PartialCollectiveError(
                f"gathering the engines' state for a checkpoint failed: {err}", rank=rank, round_index=step
            ) from err
    else:
        gathered = [states]
    if rank != 0:
        return None
    assert gathered is not None
    indices = sorted(set().union(*(g.keys() for g in gathered)))
    for r, g in enumerate(gathered):
        if set(g.keys()) != set(indices):
            raise RuntimeError(
                f"rank {r} has engines for optimizers {sorted(g.keys())}, rank 0 for {indices}: "
                "every rank must set up the same optimizers"
            )
    steps = sorted({int(s["step"]) for g in gathered for s in g.values()})
    if len(steps) > 1:
        # E.g. Lightning's SLURM auto-requeue saves from a signal handler, wherever
        # each rank is: not a consistent cut. The weights are still written;
        # resuming from this file fails with a clear error (state_for_rank).
        log.warning(
            "checkpoint taken while the ranks were at different rounds %s: its engine state cannot be resumed; "
            "save at the same step on every rank (ModelCheckpoint, or trainer.save_checkpoint from a hook)",
            steps,
        )
    return {
        "strategy": strategy,
        "family": family,
        "world_size": world_size,
        "engines": {index: [g[index] for g in gathered] for index in indices},
    }


def resume_entry(entry: Optional[dict[str, Any]], *, strategy: str, family: str) -> Optional[dict[str, Any]]:
    """The checkpoint entry if a strategy of ``family`` can resume it, else ``None`` (with a warning).

    Entries written before ``family`` existed came from eager-SGD (gradients).
    """
    if entry is None:
        log.info("the checkpoint holds no engine state (not written by a lightning_partial strategy): "
                 "the engines start afresh")
        return None
    saved = entry.get("family", "gradients")
    if saved == family:
        return entry
    pending = sum(len(s.get("pending", ())) for states in entry["engines"].values() for s in states)
    log.warning(
        "the checkpoint's engine state was written by %r, which exchanges %s; %r exchanges %s: it is ignored "
        "and the engines start afresh at round 0 (%d pending %s dropped)",
        entry.get("strategy"), saved, strategy, family, pending, saved,
    )
    return None


def state_for_rank(per_rank: list[dict[str, Any]], *, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's engine state from a checkpoint written by ``len(per_rank)`` ranks.

    Same world size: the rank's own state. Another world size: old rank ``j``'s
    pending gradients go to new rank ``j % world_size`` (they are summed in a
    later round like any carried gradient, so nothing is lost); the round
    counter and the initiator RNG are the same on every old rank.
    """
    if not per_rank:
        raise ValueError("the checkpoint holds no engine state")
    steps = {int(s["step"]) for s in per_rank}
    if len(steps) != 1:
        raise ValueError(
            f"this checkpoint was saved while the ranks' engines were at different rounds {sorted(steps)} "
            "(not at the same step on every rank, e.g. from a signal handler): its pending gradients cannot be "
            "resumed consistently; resume from a checkpoint written by ModelCheckpoint or trainer.save_checkpoint"
        )
    if len(per_rank) == world_size:
        return per_rank[rank]
    log.warning(
        "resuming a checkpoint of %d ranks on %d: old rank j's pending gradients go to rank j %% %d",
        len(per_rank),
        world_size,
        world_size,
    )
    mine = [s for j, s in enumerate(per_rank) if j % world_size == rank]
    base = per_rank[0]
    return {
        "step": base["step"],
        "initiator_rng": base["initiator_rng"],
        "pending": [p for s in mine for p in s["pending"]],
        "pending_steps": [t for s in mine for t in s["pending_steps"]],
        "dropped": sum(int(s.get("dropped", 0)) for s in mine),
    }
