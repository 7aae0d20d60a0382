import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
logging.getLogger("lightning_partial").setLevel(logging.INFO)

import pytest

# Variables a launch reads to find (or that Lightning writes once it picked) its
# rendezvous. A test that runs a Trainer in this process leaves MASTER_PORT in
# os.environ (LightningEnvironment writes the port it picked); every later
# subprocess would inherit that port and collide with whatever holds it then.
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "GLOBAL_RANK", "NODE_RANK",
               "LOCAL_WORLD_SIZE", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_rendezvous_leaks():
    """Restores the rendezvous variables after each test, as they were before it."""
    before = {k: os.environ.get(k) for k in _RENDEZVOUS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
