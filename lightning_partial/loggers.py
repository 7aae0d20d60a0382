"""The offline Weights & Biases logger: offline, silent and prompt-free by default.

One helper for every W&B run of the project: :class:`OfflineWandbLogger` (what
the recipes' configurations name as ``trainer.logger``), :func:`wandb_logger`
(the same logger, with its arguments checked) and :func:`offline_runs` (the
offline runs written under a directory, for the main job's listing).

``wandb`` is optional (the ``recipes`` extra) and is imported only when the
logger starts its run (rank 0), never when this module is imported: machines
without ``wandb`` (a GPU node, CI) can import everything in ``lightning_partial``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

from lightning.pytorch.loggers import WandbLogger  # Lightning's integration: imports wandb only when a run starts

log = logging.getLogger(__name__)

INSTALL_HINT = 'wandb is not installed: pip install -e ".[recipes]" (or pip install wandb)'
_OFFLINE_MODES = ("offline", "dryrun")


def _check(project: Any, save_dir: Any, name: Any, offline: Any) -> None:
    """The arguments' types, each failure naming the argument (``wandb_logger: project must ...``)."""
    if not isinstance(project, str) or not project:
        raise ValueError(f"wandb_logger: project must be a non-empty string, got {project!r}")
    if name is not None and not isinstance(name, str):
        raise ValueError(f"wandb_logger: name must be a string or None, got {name!r}")
    if not isinstance(save_dir, (str, Path)) or not str(save_dir):
        raise ValueError(f"wandb_logger: save_dir must be a non-empty path, got {save_dir!r}")
    if offline is not None and not isinstance(offline, bool):
        raise ValueError(f"wandb_logger: offline must be True, False or None, got {offline!r}")


class OfflineWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` that never prompts and, unless asked otherwise, never goes online.

    Args:
        project: the W&B project.
        save_dir: where the run directory goes (``<save_dir>/wandb/offline-run-*``);
            created if missing (W&B would otherwise fall back to a temporary directory).
        name: the run's display name (the recipes name an unnamed run ``<recipe>-<strategy>``).
        offline: ``True``: offline; ``False``: online (``WANDB_MODE`` may still say
            ``disabled``), whatever mode an earlier logger of the process left in
            ``WANDB_MODE``; ``None`` (default): offline unless the environment
            variable ``WANDB_MODE`` asks for another mode (e.g. ``online``). The mode
            goes to ``wandb.init(mode=...)``; a ``mode`` in ``kwargs`` wins.
        kwargs: passed on to ``WandbLogger`` (and from there to ``wandb.init``).

    Environment: sets ``WANDB_MODE=offline`` when offline and ``WANDB_SILENT=true``,
    each only if the user has not set it (the ranks Lightning starts inherit
    them). Sync an offline run later with ``wandb sync <save_dir>/wandb/offline-run-*``.

    Raises:
        ImportError: ``wandb`` is not installed (with the install command).
        ValueError: a bad ``project``, ``name``, ``save_dir`` or ``offline``.
    """

    def __init__(
        self,
        project: str = "lightning_partial",
        save_dir: Union[str, Path] = "wandb",
        name: Optional[str] = None,
        offline: Optional[bool] = None,
        **kwargs: Any,
    ) -> None:
        _check(project, save_dir, name, offline)
        # find_spec, not import: wandb is imported by the logger when its run starts (rank 0 only).
        if importlib.util.find_spec("wandb") is None:
            raise ImportError(INSTALL_HINT)
        if offline is None:
            # There is no W&B server by default: offline unless the user chose a mode.
            offline = os.environ.get("WANDB_MODE", "offline") in _OFFLINE_MODES
        if offline:
            os.environ.setdefault("WANDB_MODE", "offline")
        # The run's mode, given to wandb.init (which prefers it to the environment): the WANDB_MODE an earlier
        # offline logger of this process left behind (this class, or Lightning's own) must not turn
        # offline=False into an offline run.
        if "mode" not in kwargs:
            disabled = os.environ.get("WANDB_MODE") == "disabled"
            kwargs["mode"] = "offline" if offline else "disabled" if disabled else "online"
        os.environ.setdefault("WANDB_SILENT", "true")
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        log.info("W&B logger: project %r, %s, run directory under %s", project, "offline" if offline else "online",
                 path)
        super().__init__(project=project, save_dir=os.fspath(path), name=name, offline=offline, **kwargs)


def wandb_logger(
    *,
    project: str = "lightning_partial",
    save_dir: Union[str, Path] = "wandb",
    name: Optional[str] = None,
    offline: Optional[bool] = None,
    **kwargs: Any,
) -> OfflineWandbLogger:
    """An :class:`OfflineWandbLogger` (keyword arguments only; see the class for each of them)."""
    return OfflineWandbLogger(project=project, save_dir=save_dir, name=name, offline=offline, **kwargs)


def offline_runs(save_dir: Union[str, Path]) -> set[Path]:
    """The offline run directories an :class:`OfflineWandbLogger` wrote under ``save_dir``."""
    runs = Path(save_dir) / "wandb"
    return set(runs.glob("offline-run-*")) if runs.is_dir() else set()


__all__ = ["INSTALL_HINT", "OfflineWandbLogger", "offline_runs", "wandb_logger"]
