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
round contains. With ``eager_sgd``'s ``overlap`` a step's round is still in flight
when the step ends: every rank takes its result first (before the gather), so
the same holds, and that result (identical on every rank) is saved beside the
weights and applied by the resumed fit's first step.

Checkpoint layout (under ``checkpoint[CHECKPOINT_KEY]``)::

    {"strategy": "eager_sgd", "family": "gradients", "world_size": P,
     "engines": {optimizer_index: [state of rank 0, ..., state of rank P-1]}}

where a state is :meth:`PartialAllreduce.state_dict`. ``family`` says what the
engines exchange (``"gradients"``: eager-SGD; ``"models"``: WAGMA-SGD and
DS-Sync; ``"abs_sgd"``: ABS-SGD's gradient sums with sample counts).

What a resume accepts (checked when the file is loaded, before set-up ends and
before any batch runs, by :func:`resume_entry`):

* **Another world size: accepted.** Old rank ``j``'s pending gradients go to new
  rank ``j % P`` (:func:`state_for_rank`): every computed gradient is still
  applied, in a later round, like any carried gradient.
* **Another strategy of the same family** (``eager_sgd`` and
  ``eager_sgd_majority``; ``wagma_sgd`` and ``ds_sync``): accepted.
* **A strategy of another family: refused** with :class:`CheckpointMismatchError`
  (a ``ValueError``) naming both strategies: one family's pending tensors mean
  nothing to the other, and the project's rule is that a computed gradient is
  applied or explicitly dropped. To resume the weights, optimizer and loops
  anyway and drop the engine state, say so explicitly: write a copy without it
  with :func:`drop_engine_state` and resume from the copy.
* **A file saved while the ranks were at different rounds** (e.g. from a signal
  handler): refused (its pending gradients are not a consistent cut).
* **No engine state** (a file written by ``ddp`` or another Lightning strategy):
  the engines start afresh, nothing pending, their rounds numbered on from the
  fit's step (``eager_sgd``, ``wagma_sgd``, ``ds_sync``: a round per step, or per ``average_every`` steps)
  or from 0 (``abs_sgd``).

Writing the file (rank 0, :func:`write_checkpoint`): with the default
``TorchCheckpointIO`` and a local path, the checkpoint is written to a temporary
file in the target's directory (``.<name>.<random>.tmp``), flushed to disk and
renamed over the target with ``os.replace``, so the path holds either the previous
file or the complete new one, never a partial write; a failed write removes the
temporary file (a hard crash may leave one behind: it is an incomplete write, safe
to delete). Lightning's own write (``_atomic_save``) serialises to memory first and
then moves a file from the system temporary directory, which is a copy into the
target, not a rename, when that directory is on another file system. Remote
(fsspec) paths, ``storage_options`` and any other ``CheckpointIO`` plugin keep
that plugin's own behaviour.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from lightning_partial.collectives.errors import naming_failure
from lightning_partial.strategies.accumulation import ACCUMULATED_KEY

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "lightning_partial"
#: ``eager_sgd``'s ``overlap``: each optimizer's round result taken at the save and not yet applied
#: (:class:`~lightning_partial.strategies.overlap.InFlight`): ``{index: {"tensors": [...], "applied": bool}}``.
IN_FLIGHT_KEY = "lightning_partial_in_flight"
#: The options that shaped the engines' saved state, those set only (``find_unused_parameters``: a presence
#: number per parameter tensor rides with every gradient); a resume with another value is refused.
LAYOUT_KEY = "lightning_partial_layout"



def family_strategies() -> dict[str, tuple[str, ...]]:
    """The registry names of each engine family (what a checkpoint of that family can be resumed with).

    Read from each shipped strategy class's ``engine_family`` and ``registry_entries``.
    """
    from lightning_partial.strategies import STRATEGIES  # here: the strategies import this module

    families: dict[str, tuple[str, ...]] = {}
    for cls in STRATEGIES:
        families[cls.engine_family] = families.get(cls.engine_family, ()) + tuple(e[0] for e in cls.registry_entries)
    return families


def __getattr__(name: str) -> Any:
    if name == "FAMILY_STRATEGIES":  # family_strategies(), under the name it had as a table
        return family_strategies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CheckpointMismatchError(ValueError):
    """A checkpoint whose engine state the current strategy cannot resume; the message says why and what to do.

    ``reason`` is the message without the file's name; ``source`` the file (``None`` if not known).
    """

    def __init__(self, reason: str, source: Optional[_PATH] = None) -> None:
        self.reason = reason
        self.source = source
        super().__init__(f"ckpt_path {str(source)!r}: {reason}" if source is not None else reason)


def gather_engine_states(
    states: dict[int, dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    strategy: str,
    family: str,
    group: Optional[Any] = None,
    verdict: Optional[Callable[[BaseException], Optional[BaseException]]] = None,
) -> Optional[dict[str, Any]]:
    """Collective on ``group`` (default: the default group): returns the checkpoint entry on rank 0, ``None`` elsewhere.

    ``verdict``: a failed gather names the rank that is gone where it gives one (see ``naming_failure``)."""
    gathered: Optional[list[Any]] = [None] * world_size if rank == 0 else None
    if world_size > 1:
        # Bounded by the group's timeout (the strategy's ``timeout``); a dead or stalled rank: say which rank
        # and which round.
        step = next((int(s["step"]) for s in states.values()), None)
        with naming_failure("gathering the engines' state for a checkpoint", rank=rank, round_index=step,
                            verdict=verdict):
            dist.gather_object(states, gathered, dst=0, group=group)
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
        # resuming from this file fails with a clear error (resume_entry).
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


# ------------------------------------------------------------------ resume
def _pending_count(entry: dict[str, Any]) -> int:
    return sum(len(s.get("pending", ())) for states in entry.get("engines", {}).values() for s in states)


def _check_entry(entry: Any, source: Optional[_PATH]) -> None:
    """Raises :class:`CheckpointMismatchError` if ``entry`` is not a complete, consistent engine state."""
    if not isinstance(entry, dict) or not isinstance(entry.get("engines"), dict):
        raise CheckpointMismatchError(
            f"the checkpoint's {CHECKPOINT_KEY!r} entry is malformed (expected a dict with 'strategy', 'family', "
            f"'world_size' and 'engines', got {type(entry).__name__} with keys "
            f"{sorted(entry) if isinstance(entry, dict) else '-'}): it was not written by this version of "
            "lightning_partial; remove the entry (drop_engine_state) to resume the weights only",
            source,
        )
    for index, per_rank in entry["engines"].items():
        if not isinstance(per_rank, list) or not per_rank or not all(isinstance(s, dict) and "step" in s
                                                                     for s in per_rank):
            raise CheckpointMismatchError(
                f"the checkpoint's engine state for optimizer {index} is malformed (expected one state dict per "
                "rank, each with a 'step')",
                source,
            )
        saved_world = entry.get("world_size")
        if saved_world is not None and len(per_rank) != int(saved_world):
            raise CheckpointMismatchError(
                f"the checkpoint's engine state for optimizer {index} has {len(per_rank)} rank states but "
                f"world_size={saved_world}: the file is inconsistent",
                source,
            )
        steps = sorted({int(s["step"]) for s in per_rank})
        if len(steps) > 1:
            raise CheckpointMismatchError(
                f"this checkpoint was saved while the ranks' engines were at different rounds {steps} (not at the "
                "same step on every rank, e.g. from a signal handler): its pending gradients cannot be resumed "
                "consistently; resume from a checkpoint written by ModelCheckpoint or trainer.save_checkpoint, or "
                "drop its engine state explicitly (lightning_partial.strategies.checkpoint.drop_engine_state)",
                source,
            )


def resume_entry(
    entry: Optional[dict[str, Any]],
    *,
    strategy: str,
    family: str,
    drop_foreign: bool = False,
    source: Optional[_PATH] = None,
) -> Optional[dict[str, Any]]:
    """The checkpoint entry if a strategy of ``family`` can resume it (see the module docstring).

    Returns ``None`` for a checkpoint without engine state (the engines start
    afresh). Raises :class:`CheckpointMismatchError` for an entry written by a
    strategy of another family (unless ``drop_foreign``: then it is dropped with
    a warning saying how many pending tensors are lost), for an entry saved
    while the ranks were at different rounds, and for a malformed entry. Entries
    written before ``family`` existed came from eager-SGD (gradients). ``source``:
    the checkpoint's path, named in the error.
    """
    if entry is None:
        log.info("the checkpoint holds no engine state (not written by a lightning_partial strategy): "
                 "the engines start afresh")
        return None
    _check_entry(entry, source)
    saved = entry.get("family", "gradients")
    if saved == family:
        return entry
    pending = _pending_count(entry)
    what = f"{pending} pending {'gradient' if saved == 'gradients' else 'tensor'} set(s)"
    if drop_foreign:
        log.warning(
            "the checkpoint's engine state was written by %r, which exchanges %s; %r exchanges %s: it is dropped "
            "as asked and the engines start afresh (%s dropped)",
            entry.get("strategy"), saved, strategy, family, what,
        )
        return None
    same = ", ".join(family_strategies().get(saved, (str(entry.get("strategy")),)))
    raise CheckpointMismatchError(
        f"this checkpoint was written by strategy {entry.get('strategy')!r} (engine family {saved!r}, "
        f"world size {entry.get('world_size')}, {what}), but the current strategy {strategy!r} belongs to the "
        f"{family!r} family and cannot resume that engine state. Resume it with one of: {same}; or drop its engine "
        f"state explicitly (the {what} are lost; the weights, optimizer and loops are kept): "
        f"lightning_partial.strategies.checkpoint.drop_engine_state(<this file>, <new file>), then resume from "
        f"the new file",
        source,
    )


def state_for_rank(per_rank: list[dict[str, Any]], *, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's engine state from a checkpoint written by ``len(per_rank)`` ranks.

    Same world size: the rank's own state. Another world size (accepted): old rank
    ``j``'s pending gradients go to new rank ``j % world_size`` (they are summed in a
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


def drop_engine_state(src: _PATH, dst: _PATH) -> int:
    """Writes a copy of checkpoint ``src`` without its engine state to ``dst``; returns the pending sets dropped.

    The explicit way to resume a checkpoint under a strategy of another family
    (see :func:`resume_entry`): the weights, optimizer and loop state are kept, the
    engines start afresh (their rounds numbered on from the fit's step, a round per step or per ``average_every``)
    and the pending gradients are lost (with
    ``eager_sgd``'s ``overlap``, the round results saved unapplied too; with ``abs_sgd``, the rounds it had
    summed towards its next step, one set per optimizer that had any). ``src`` is
    not modified; ``dst`` is written atomically (:func:`save_atomically`).
    """
    if Path(src).resolve() == Path(dst).resolve():
        raise ValueError("drop_engine_state: write the copy to another file (dst must differ from src)")
    checkpoint = torch.load(src, map_location="cpu", weights_only=False)
    entry = checkpoint.pop(CHECKPOINT_KEY, None)
    dropped = _pending_count(entry) if isinstance(entry, dict) else 0
    checkpoint.pop(LAYOUT_KEY, None)  # what shaped the engine state dropped here
    in_flight = checkpoint.pop(IN_FLIGHT_KEY, None)  # eager_sgd overlap: a result per optimizer, not yet applied
    dropped += len(in_flight) if isinstance(in_flight, dict) else 0
    # abs_sgd: completed rounds summed towards the next optimizer step. Kept, another family would ignore them
    # without a word, and abs_sgd would add them to rounds its fresh engines number anew. The step count stays:
    # a fit's, not the engine's (it phases the schedulers' frequency).
    accumulated = checkpoint.get(ACCUMULATED_KEY)
    if isinstance(accumulated, dict):
        dropped += sum(1 for s in accumulated.values() if isinstance(s, dict) and s.get("samples"))
        checkpoint[ACCUMULATED_KEY] = {i: {"sum": None, "samples": 0, "rounds": 0, "steps": s.get("steps", 0)}
                                       for i, s in accumulated.items() if isinstance(s, dict)}
    save_atomically(checkpoint, dst)
    log.warning("%s: engine state dropped (%d pending set(s)); written to %s", src, dropped, dst)
    return dropped


# ------------------------------------------------------------------ writing
def _file_mode(path: Path) -> int:
    """The target's permissions if it exists, else what ``open()`` would create (``0o666`` less the umask)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def save_atomically(checkpoint: dict[str, Any], filepath: _PATH) -> None:
    """``torch.save`` to a temporary file next to ``filepath``, then ``os.replace`` onto it (local paths).

    The target holds either its previous content or the complete new checkpoint:
    a failure while pickling or writing removes the temporary file and leaves the
    target as it was. The data and the directory entry are flushed (``fsync``)
    before and after the rename.
    """
    path = Path(filepath)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, _file_mode(path))
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash (POSIX; best effort elsewhere)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _local_path(filepath: _PATH) -> Optional[str]:
    """``filepath`` as a local file system path (``file://`` stripped), or ``None`` for a remote one."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(str(filepath))
    return path if isinstance(fs, LocalFileSystem) else None


def write_checkpoint(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
) -> None:
    """Rank 0's write of a checkpoint file: atomic for the default ``TorchCheckpointIO`` and a local path.

    Any other ``CheckpointIO`` (a user's plugin, ``AsyncCheckpointIO``), a remote
    fsspec path or ``storage_options`` is handed to ``checkpoint_io`` as Lightning
    does (see the module docstring).
    """
    local = _local_path(filepath) if type(checkpoint_io) is TorchCheckpointIO and storage_options is None else None
    if local is not None:
        save_atomically(checkpoint, local)
    else:
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
