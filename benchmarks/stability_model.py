"""Largest stable learning rate of SGD with momentum on a quadratic, under late gradients, per staleness rule.

Pure Python and numpy (seconds). The loss is ``lam * x**2 / 2``; ``h = lr * lam``.
Torch's SGD: ``v <- mu v + g``, ``x <- x - lr v``. Two ways gradients come late:

* ``uniform``: every gradient is ``tau`` rounds late (``abs_sgd``: ``tau = 1``).
* ``solo``: a fraction ``f`` of each round's gradient is fresh and the rest one
  round late (``eager_sgd`` solo: the activator's gradient is fresh, the
  others' arrive just after the round started; ``f = 1/4`` with 4 ranks).
* ``lagged``: each step's gradient is a mixture, a share ``p_k`` computed
  ``k`` steps before the weights it is applied to (``abs_sgd``'s measured step
  lags: ``--lags``, the heterogeneity benchmark's ``abs_step_lag_shares``),
  with linear weight prediction by ``c`` steps (0: none; 1: ``abs_sgd``'s;
  ``k``: each share by its own lag) and ``abs_sgd``'s spike compensation of
  the whole step (``mu g`` into the buffer, ``g`` applied at once) or none;
  and, for the first mixture, less momentum at the user's ``lr / (1 - mu)``.

For each rule (:mod:`lightning_partial.collectives.staleness`) the script
builds the linear recurrence and reports the largest ``h`` (scanned from 0)
whose spectral radius stays below 1. Undelayed momentum SGD is stable for
``h < 2 (1 + mu) = 3.8`` at ``mu = 0.9``.

    .venv/bin/python -m benchmarks.stability_model   # writes benchmarks/results/stability_model.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parent


def _radius(step: Callable[[np.ndarray], np.ndarray], n: int) -> float:
    matrix = np.stack([step(e) for e in np.eye(n)], axis=1)
    return float(max(abs(np.linalg.eigvals(matrix))))


def uniform(rule: str, h: float, mu: float, tau: int) -> float:
    """Spectral radius: every gradient ``tau`` rounds late. State: x_t .. x_{t-tau}, v_t."""
    w = {"none": 1.0, "momentum": mu**tau, "inverse": 1.0 / (1 + tau), "spike": mu**tau}[rule]
    spike = (1 - mu**tau) / (1 - mu) if rule == "spike" else 0.0

    def step(s: np.ndarray) -> np.ndarray:
        x, v = s[: tau + 1], s[tau + 1]
        g = x[tau]
        v_next = mu * v + w * g
        x_next = x[0] - h * (v_next + spike * g)
        return np.concatenate([[x_next], x[:tau], [v_next]])

    return _radius(step, tau + 2)


def solo(rule: str, h: float, mu: float, fresh: float) -> float:
    """Spectral radius: a share ``fresh`` of each round on time, the rest one round late."""
    w = {"none": 1.0, "momentum": mu, "inverse": 0.5, "spike": mu, "drop": 0.0}[rule]
    spike = 1.0 if rule == "spike" else 0.0

    def step(s: np.ndarray) -> np.ndarray:
        x0, x1, v = s
        stale = (1 - fresh) * x1
        v_next = mu * v + fresh * x0 + w * stale
        return np.array([x0 - h * (v_next + spike * stale), x0, v_next])

    return _radius(step, 3)


def lagged(rule: str, h: float, mu: float, shares: list[float], prediction: str) -> float:
    """Spectral radius: a share ``shares[k]`` of each step's gradient from the weights ``k`` steps back.

    Predicted by ``c`` steps (``prediction``: ``"none"`` 0, ``"one"`` 1, ``"own"`` k); state x_t .. x_{t-K-1}, v_t.
    """
    lags = len(shares)
    c = [{"none": 0.0, "one": 1.0, "own": float(k)}[prediction] for k in range(lags)]
    w, spike = (mu, 1.0) if rule == "spike" else (1.0, 0.0)

    def step(s: np.ndarray) -> np.ndarray:
        x, v = s[: lags + 1], s[lags + 1]
        g = sum(p * (x[k] + c[k] * (x[k] - x[k + 1])) for k, p in enumerate(shares))
        v_next = mu * v + w * g
        x_next = x[0] - h * (v_next + spike * g)
        return np.concatenate([[x_next], x[:lags], [v_next]])

    return _radius(step, lags + 2)


def measured_shares(path: Path) -> list[float] | None:
    """``abs_step_lag_shares`` of a heterogeneity benchmark's results, if it recorded them."""
    if not path.exists():
        return None
    shares = json.loads(path.read_text()).get("summary", {}).get("abs_step_lag_shares")
    return [float(x) for x in shares] if shares else None


def largest_stable(radius: Callable[[float], float], top: float = 20.0, points: int = 20_000) -> float:
    stable = 0.0
    for h in np.linspace(top / points, top, points):
        if radius(h) >= 1.0:
            break
        stable = float(h)
    return stable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--fresh", type=float, default=0.25, help="solo: the share of a round that is on time")
    parser.add_argument("--lags", type=Path, nargs="*",
                        default=[HERE / "results" / "heterogeneity_lags.json",
                                 HERE / "results" / "heterogeneity_adaptive_lags.json"],
                        help="heterogeneity benchmark results with abs_sgd's step lags (each skipped if absent)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "stability_model.json")
    args = parser.parse_args(argv)
    mu = args.momentum
    rows: list[dict[str, object]] = []
    on_time = largest_stable(lambda h: uniform("none", h, mu, 0))
    rows.append({"delay": "none", "rule": "-", "largest_stable_h": on_time})
    for tau in (1, 2, 4):
        for rule in ("none", "momentum", "inverse", "spike"):
            rows.append({"delay": f"uniform tau={tau}", "rule": rule,
                         "largest_stable_h": largest_stable(lambda h, rule=rule, tau=tau: uniform(rule, h, mu, tau))})
    for rule in ("none", "momentum", "inverse", "spike", "drop"):
        rows.append({"delay": f"solo, {args.fresh:g} fresh", "rule": rule,
                     "largest_stable_h": largest_stable(lambda h, rule=rule: solo(rule, h, mu, args.fresh))})
    measured = {path.stem: shares for path in args.lags if (shares := measured_shares(path)) is not None}
    mixtures = [(f"{stem}: " + ", ".join(f"{p:.2f}" for p in shares), shares) for stem, shares in measured.items()]
    mixtures += [(f"{f:g} on time, the rest 1 step late", [f, 1 - f]) for f in (0.0, 0.25, 0.5, 0.75)]
    for label, shares in mixtures:
        for rule in ("none", "spike"):
            for prediction in ("none", "one", "own"):
                rows.append({"delay": f"step lags {label}", "rule": f"{rule}, prediction {prediction}",
                             "largest_stable_h": largest_stable(
                                 lambda h, rule=rule, shares=shares, prediction=prediction:
                                 lagged(rule, h, mu, shares, prediction), top=5.0, points=5_000)})
    # Less explicit momentum for late gradients (Mitliagkas et al., 2016: asynchrony acts as momentum), at the same
    # lr / (1 - momentum) as the user's: the optimizer's lr is h (1 - m) / (1 - mu), h in the user's units.
    for label, shares in mixtures[:1]:
        for m in (0.8, 0.5, 0.0):
            rows.append({"delay": f"step lags {label}", "rule": f"spike, prediction one, momentum {m:g}",
                         "largest_stable_h": largest_stable(
                             lambda h, shares=shares, m=m: lagged("spike", h * (1 - m) / (1 - mu), m, shares, "one"),
                             top=5.0, points=5_000)})
    print(f"SGD momentum {mu}: largest stable lr * curvature (undelayed: {on_time:.3f})")
    for row in rows:
        print(f"  {row['delay']:<48} {row['rule']:<25} {row['largest_stable_h']:.3f}")
    args.out.write_text(json.dumps({"momentum": mu, "fresh": args.fresh, "lags": measured, "rows": rows}, indent=1)
                        + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
