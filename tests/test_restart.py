"""Restart and resume under torchrun: a rank killed mid-fit, the group restarted, nothing lost.

``torchrun --max-restarts 1`` runs ``tests/scripts/exact.py`` (linear in its data,
so the final weights follow bit for bit from what the ranks computed) with a
``ModelCheckpoint`` every 4 steps and ``save_last``. In the first attempt rank 2
kills itself (SIGKILL) after the checkpoint of step 8; torchrun ends the others
and restarts all four, which find ``last.ckpt`` and resume from it. Rank 3 is
persistently slow, so the checkpoint holds carried gradients: the final weights
equal the formula only if those were applied after the restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_partial.strategies.checkpoint import CHECKPOINT_KEY

SCRIPT = "tests.scripts.exact"  # run as `python -m` from the repository root
# torch's own workaround for restarts on torchrun's shared rendezvous store (pytorch#135712; the strategy
# warns without it): each attempt gets a store of its own.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
WORLD = 4


def seen(out: Path, rank: int, attempt: int) -> list[dict]:
    path = out / f"seen.rank{rank}.attempt{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def computed(items: list[dict]) -> torch.Tensor:
    total = torch.zeros(len(items[0]["x"]), dtype=torch.float64)
    for item in items:
        total += torch.tensor(item["x"], dtype=torch.float64)
    return total


@pytest.mark.timeout(300)
def test_torchrun_restart_resumes_from_the_last_checkpoint_with_every_carried_gradient(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
        "--max-restarts", "1", "-m", SCRIPT, "--out", str(out), "--strategy", "eager_sgd", "--steps", "14",
        "--checkpoint-every", "4", "--die-at", "10", "--die-rank", "2", "--slow-ms", "40",
    ]
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # The first attempt died; the second one ran to the end.
    assert all((out / f"seen.rank{r}.attempt1.jsonl").exists() for r in range(WORLD)), proc.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rec in records[1:]:
        assert rec["final"] == records[0]["final"], f"rank {rec['rank']} differs from rank 0"

    last = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    # last.ckpt was overwritten by the second attempt; the one it resumed from is step 8's.
    resumed = torch.load(next((out / "ckpt").glob("*step=8.ckpt")), weights_only=False)
    assert resumed["global_step"] == 8 and last["global_step"] >= 12
    states = resumed[CHECKPOINT_KEY]["engines"][0]
    assert {s["step"] for s in states} == {8}
    # The slow rank's late gradients were pending at the save: the test has teeth.
    assert sum(len(s["pending"]) for s in states) >= 1, states

    second = [seen(out, r, 1) for r in range(WORLD)]
    assert all(item["step"] >= 8 for items in second for item in items)
    before = [item for r in range(WORLD) for item in seen(out, r, 0) if item["step"] < 8]
    total = computed(before) + computed([item for items in second for item in items])
    lr = records[0]["lr"]
    want = (torch.tensor(records[0]["w0"]["w"], dtype=torch.float64) - lr / WORLD * total).tolist()
    assert records[0]["final"]["w"] == want
