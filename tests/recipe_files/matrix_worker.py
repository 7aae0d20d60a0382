"""One rank of the recipe x strategy matrix (tests/test_recipes.py starts one such process per rank).

The test starts the ranks itself, as torchrun or SLURM would (``LOCAL_RANK``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; Lightning's
``LightningEnvironment`` then launches nothing), so that one pair of processes
runs many short fits one after the other instead of paying Python's and
Lightning's start-up (~10 s on 2 cores) for each: every item is a real
multi-process fit through the recipe's own CLI (``RECIPES[name].run(args)``),
over gloo, on the default process group that the first fit creates and the
next ones reuse.

Items come from a JSON file: ``[{"id": ..., "recipe": ..., "args": [...]}, ...]``.
For each, this rank writes ``<out>/<id>/done<R>`` after the fit (the recipe's
``FitSummary`` writes ``rank<R>.json`` beside it), or ``<out>/<id>/error<R>.txt``
and exits with status 1: after a failure the process group cannot be trusted,
so the test starts a fresh pair for the items left. A fit that takes longer
than ``--fit-timeout`` seconds dumps every thread's stack and ends the process
(``faulthandler``): a hang becomes a failure with a traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fit-timeout", type=float, default=120.0)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    items = json.loads(args.items.read_text())
    sys.argv = [sys.argv[0]]  # LightningCLI gets its arguments from `args`, not from this command line

    from recipes.catalog import RECIPES

    for item in items:
        out = args.out / item["id"]
        out.mkdir(parents=True, exist_ok=True)
        faulthandler.dump_traceback_later(args.fit_timeout, exit=True)
        try:
            RECIPES[item["recipe"]].run(args=item["args"])
        except BaseException as err:  # noqa: BLE001 - SystemExit too: a config error ends the CLI that way
            (out / f"error{rank}.txt").write_text("".join(traceback.format_exception(err)))
            return 1
        finally:
            faulthandler.cancel_dump_traceback_later()
        (out / f"done{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
