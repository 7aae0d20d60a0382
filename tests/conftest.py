import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
logging.getLogger("lightning_partial").setLevel(logging.INFO)

import pytest

# A test that runs a Trainer in this process leaves MASTER_PORT in os.environ
# (LightningEnvironment writes the port it picked); every later subprocess would
# inherit that port and collide with whatever holds it then.
from tests.scripts.ports import RANK_VARIABLES  # noqa: E402


@pytest.fixture(autouse=True)
def _no_rendezvous_leaks():
    """Restores the rendezvous variables after each test, as they were before it."""
    before = {k: os.environ.get(k) for k in RANK_VARIABLES}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def retired(monkeypatch):
    """The ranks whose engine's close() handed its groups to a daemon thread (``_retire_groups``)."""
    from lightning_partial.collectives import PartialAllreduce

    ranks: list[int] = []
    original = PartialAllreduce._retire_groups

    def spy(self):  # type: ignore[no-untyped-def]
        ranks.append(self.rank)
        original(self)

    monkeypatch.setattr(PartialAllreduce, "_retire_groups", spy)
    return ranks
