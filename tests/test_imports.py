"""Importing lightning_partial: the engine without Lightning, the strategy names registered either way.

Each case runs in a fresh interpreter (``sys.modules`` of this one has Lightning already),
with this checkout first on ``PYTHONPATH``. An interpreter that imports Lightning spends
about 10 s of one core on it: the module's cases start together, as many at once as the
host has cores (:func:`ran`), and each test reads its own case's outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: name -> the code one fresh interpreter runs (filled below, beside the test that reads it)
CASES: dict[str, str] = {}


def case(name: str, code: str) -> str:
    CASES[name] = textwrap.dedent(code)
    return name


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a new interpreter; one that runs past 120 s is killed and reported as failed (its own
    test fails with its output, not every test of the module)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", code]
    try:
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        def text(out: bytes | str | None) -> str:
            return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")

        return subprocess.CompletedProcess(command, -1, text(err.stdout), text(err.stderr) + "\ntimed out after 120 s")


@pytest.fixture(scope="module")
def ran() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case's outcome, the interpreters run side by side (at most one per core)."""
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(run_python, code) for name, code in CASES.items()}
        return {name: future.result() for name, future in futures.items()}


def check(done: subprocess.CompletedProcess[str]) -> None:
    """The interpreter exited 0, and nothing failed to register."""
    assert done.returncode == 0, done.stdout + done.stderr
    assert "could not register" not in done.stderr, done.stderr


ENGINE_ALONE = case("engine_alone", f"""
    import sys
    import lightning_partial.collectives
    assert lightning_partial.__file__.startswith({str(ROOT)!r}), lightning_partial.__file__
    assert "lightning" not in sys.modules, sorted(m for m in sys.modules if m.startswith("lightning."))
""")

REGISTERED = """
import sys
from lightning_partial._registration import _RegisterAfterImport
names = ("eager_sgd", "eager_sgd_majority", "eager_sgd_backup", "wagma_sgd", "ds_sync", "abs_sgd")
for name in names:
    for twin in ("", "_spawn", "_fork"):
        assert name + twin in pl.strategies.StrategyRegistry, name + twin
assert not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path)  # the hook removed itself
assert type(pl.__spec__.loader).__name__ == type(pl.__loader__).__name__ == "SourceFileLoader"
"""
ORDERS = {
    "lightning_partial": case("package_first", "import lightning_partial\nimport lightning.pytorch as pl" + REGISTERED),
    "lightning": case("lightning_first", "import lightning.pytorch as pl\nimport lightning_partial" + REGISTERED),
}

TRAINER_BY_NAME = case("trainer_by_name", """
    import lightning_partial
    import lightning as L
    trainer = L.Trainer(strategy="eager_sgd", accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert type(trainer.strategy).__name__ == "EagerSGDStrategy"
""")

CLASSES = case("classes", """
    import sys
    import lightning_partial
    assert "lightning" not in sys.modules  # nothing loaded until a strategy is asked for
    from lightning_partial import ABSSGDStrategy, DSSyncStrategy, EagerSGDStrategy, WAGMAStrategy
    from lightning_partial.strategies import EagerSGDStrategy as same
    assert EagerSGDStrategy is same and EagerSGDStrategy().strategy_name == "eager_sgd"
    from lightning.pytorch.strategies import StrategyRegistry
    assert StrategyRegistry["wagma_sgd"]["strategy"] is WAGMAStrategy
""")

IDEMPOTENT = case("idempotent", """
    import sys
    import lightning_partial
    from lightning_partial import _registration
    _registration.install()
    _registration.install()
    assert sum(isinstance(f, _registration._RegisterAfterImport) for f in sys.meta_path) == 1
    import lightning.pytorch
    from lightning_partial.strategies import register_strategies
    register_strategies()
    _registration.install()  # Lightning imported: registers again, harmlessly
    assert not any(isinstance(f, _registration._RegisterAfterImport) for f in sys.meta_path)
    assert "eager_sgd" in lightning.pytorch.strategies.StrategyRegistry
""")

SPEC_LOOKUP = case("spec_lookup", """
    import sys
    import lightning_partial
    from lightning_partial._registration import _RegisterAfterImport
    hook = next(f for f in sys.meta_path if isinstance(f, _RegisterAfterImport))
    hook.find_spec("lightning.pytorch", None)  # the lookup alone
    assert hook in sys.meta_path  # still there: nothing was imported
    import lightning.pytorch as pl
    assert "eager_sgd" in pl.strategies.StrategyRegistry
    assert hook not in sys.meta_path
""")

SUBMODULE = case("submodule", """
    import lightning_partial
    lightning_partial.strategies.register_strategies()  # what the hook's warning tells a user to call
    import lightning.pytorch as pl
    assert "abs_sgd" in pl.strategies.StrategyRegistry
""")


def test_the_engine_imports_without_lightning(ran) -> None:
    check(ran[ENGINE_ALONE])


@pytest.mark.parametrize("first", ["lightning_partial", "lightning"])
def test_the_strategy_names_are_registered_in_either_import_order(ran, first: str) -> None:
    check(ran[ORDERS[first]])


def test_import_lightning_then_trainer_by_name(ran) -> None:
    check(ran[TRAINER_BY_NAME])


def test_strategy_classes_from_the_package(ran) -> None:
    check(ran[CLASSES])


def test_the_hook_is_idempotent(ran) -> None:
    check(ran[IDEMPOTENT])


def test_a_spec_lookup_leaves_the_hook_for_the_import(ran) -> None:
    """A lookup of lightning.pytorch's spec that imports nothing does not use the hook up."""
    check(ran[SPEC_LOOKUP])


def test_the_strategies_submodule_is_an_attribute_after_a_bare_import(ran) -> None:
    check(ran[SUBMODULE])
