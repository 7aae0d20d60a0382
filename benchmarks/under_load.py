"""Fits under load, at the default timeouts: no spurious timeout, no hang.

Two scenarios per strategy, each a real 4-process fit of ``tests/scripts/fit.py`` (``python -m tests.scripts.fit``)
(Lightning launches the ranks) with the strategy's defaults (``timeout`` 30 min,
``collective_timeout`` 60 s, the heartbeat):

* ``oversubscribed``: two processes that burn a CPU each run beside the 4 ranks
  (on a 2-core host: 6 busy processes on 2 cores);
* ``slow_rank``: rank 3 runs 10x slower than the others (``LoadImbalance``
  ``speed=1,1,1,0.1``) for a whole epoch.

Records each fit's exit code, wall time and whether its output mentions a
timeout or a verdict, to ``benchmarks/results/under_load.json``.

Usage::

    python -m benchmarks.under_load                      # all four strategies, both scenarios
    python -m benchmarks.under_load --strategies eager_sgd --scenarios slow_rank
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.under_load")

ROOT = Path(__file__).resolve().parents[1]
FIT = "tests.scripts.fit"  # run as python -m from the repository root
STRATEGIES = ("eager_sgd", "wagma_sgd", "ds_sync", "abs_sgd")
SCENARIOS: dict[str, list[str]] = {
    "oversubscribed": ["--steps", "300", "--straggle-ms", "5"],
    "slow_rank": ["--max-epochs", "1", "--speed", "1,1,1,0.1"],
}
BURN = "import time\nwhile True:\n    time.perf_counter()\n"
SIGNS_OF_TROUBLE = ("PartialCollectiveTimeout", "has not answered", "timed out", "Traceback")


def run_fit(strategy: str, scenario: str, *, burners: int, limit_s: float) -> dict[str, Any]:
    """One fit; returns its record (exit code, wall time, troubles seen in its output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    burning = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(burners)]
    try:
        with tempfile.TemporaryDirectory() as out:
            started = time.monotonic()
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", FIT, "--out", out, "--strategy", strategy, *SCENARIOS[scenario]],
                    env=env, cwd=ROOT, capture_output=True, text=True, timeout=limit_s,
                )
                code: int | None = proc.returncode
                output = proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as err:
                code, output = None, str(err.stderr or "")
            seconds = time.monotonic() - started
            records = [json.loads(p.read_text()) for p in sorted(Path(out).glob("callbacks*.json"))]
    finally:
        for p in burning:
            p.kill()
            p.wait()
    troubles = sorted({s for s in SIGNS_OF_TROUBLE if s in output})
    record = {
        "strategy": strategy,
        "scenario": scenario,
        "burners": burners,
        "exit_code": code,
        "wall_s": round(seconds, 1),
        "troubles": troubles,
        "global_steps": [r.get("global_step") for r in records],
    }
    if code != 0 or troubles:
        record["output_tail"] = output[-3000:]
    return record


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--burners", type=int, default=2, help="CPU-burning processes in 'oversubscribed'")
    parser.add_argument("--limit-s", type=float, default=900.0, help="a fit still running after this is a hang")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "under_load.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = []
    for scenario in args.scenarios:
        for strategy in args.strategies:
            burners = args.burners if scenario == "oversubscribed" else 0
            record = run_fit(strategy, scenario, burners=burners, limit_s=args.limit_s)
            log.info("%-14s %-10s exit %s in %6.1f s  troubles %s", scenario, strategy, record["exit_code"],
                     record["wall_s"], record["troubles"] or "none")
            results.append(record)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"host_cpus": os.cpu_count(), "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
