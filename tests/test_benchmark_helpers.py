"""The heterogeneity benchmark's pure helpers: the no-communication bound and the cnn task's data and model."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import heterogeneity  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _rank(t_start: float, batch_times: list[float], *, batch: int, t_end: float) -> dict:
    return {"t_start": t_start, "t_end": t_end, "samples": batch * len(batch_times), "batches": len(batch_times),
            "trace": [(t - t_start, 1.0) for t in batch_times]}


def test_the_bound_counts_only_the_window_in_which_every_rank_trains():
    # A fast rank: 10 batches in [0, 1); a slow one: batches at 0, 0.5, 1, ..., 4.5 (it goes on alone after 1 s).
    fast = _rank(0.0, [i / 10 for i in range(10)], batch=8, t_end=1.0)
    slow = _rank(0.0, [i / 2 for i in range(10)], batch=8, t_end=5.0)
    # Window [0, 1]: the fast rank's 10 batches and the slow rank's batches at 0, 0.5 and 1.
    assert heterogeneity.concurrent_speed([fast, slow]) == pytest.approx((10 + 3) * 8 / 1.0)
    # Over each rank's own interval the slow rank's lone seconds would count: 80/1 + 80/5.
    own = sum(r["samples"] / (r["t_end"] - r["t_start"]) for r in (fast, slow))
    assert own == pytest.approx(96.0)


def test_the_bound_window_starts_at_the_last_rank_to_start():
    early = _rank(0.0, [0.0, 1.0, 2.0, 3.0], batch=4, t_end=4.0)
    late = _rank(2.0, [2.0, 3.0], batch=4, t_end=4.0)
    # Window [2, 4]: two batches each.
    assert heterogeneity.concurrent_speed([early, late]) == pytest.approx(4 * 4 / 2.0)


def test_the_cnn_task_is_cached_deterministic_and_buffer_free(tmp_path):
    first = heterogeneity.image_task(3, 64, tmp_path)
    assert len(list(tmp_path.glob("images.*.pt"))) == 1
    again = heterogeneity.image_task(3, 64, tmp_path)  # read back from the cache
    assert torch.equal(first["x_train"], again["x_train"]) and torch.equal(first["y_test"], again["y_test"])
    assert first["x_train"].shape == (64, 3, heterogeneity.IMAGE_SIZE, heterogeneity.IMAGE_SIZE)
    assert len(first["x_test"]) == heterogeneity.IMAGE_TEST_SAMPLES
    assert set(first["y_train"].tolist()) <= set(range(10))
    net = heterogeneity.build_cnn()
    assert not list(net.buffers())  # DDP would broadcast buffers at every step
    assert net(first["x_train"][:4]).shape == (4, 10)
