import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch resolves the peer of every new TCPStore connection by reverse DNS; where the DNS server drops a query
# (this host's does: about one connection in thirty stalled), the connection waits for glibc's 5 s resolver
# timeout. 1 s here, for this process and every rank it starts (docs/reliability.md, "Store connections and the
# host's resolver").
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
logging.getLogger("lightning_partial").setLevel(logging.INFO)

import pytest  # noqa: E402 - OMP_NUM_THREADS is set before anything imports torch

# A test that runs a Trainer in this process leaves MASTER_PORT in os.environ
# (LightningEnvironment writes the port it picked); every later subprocess would
# inherit that port and collide with whatever holds it then.
from tests.scripts.ports import RANK_VARIABLES  # noqa: E402


#: The pure-logic tier: modules whose tests start no ranks, no process group and no
#: Trainer fit (`pytest -m "not slow"`, well under a minute). Every other module is
#: marked ``slow``: a new test module joins the fast tier only by being named here,
#: so a multi-rank test never slips into it.
FAST_MODULES = frozenset({
    "test_bad_input.py",
    "test_benchmark_helpers.py",
    "test_checkpoint_files.py",
    "test_imports.py",
    "test_staleness.py",
    "test_units.py",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)


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
