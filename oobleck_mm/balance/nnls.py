"""Non-negative least squares, plain and robust to outliers, for the balancer's small cost fits.

SciPy may be absent where the engine runs, so this is Lawson and Hanson's
active-set algorithm (1974, ch. 23) in numpy; the systems here have a handful
of columns, so each inner least-squares solve is trivial.

``robust_nnls`` makes it robust with iteratively reweighted least squares:
Huber weights first (convex, converges from the plain fit), then Tukey
bisquare weights, which give gross outliers (a stalled step, a page fault, a
straggling peer) weight zero instead of Huber's bounded but non-zero pull.
The residual scale is the normalised median absolute deviation, so up to
about a third of the rows may be outliers before the fit breaks down.
"""

from __future__ import annotations

import numpy as np

HUBER_K = 1.345
BISQUARE_C = 4.685
_MAD_TO_SIGMA = 1.4826


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """``argmin ||a x - b||_2`` subject to ``x >= 0`` (Lawson-Hanson)."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls: a must be (m, n) and b (m,), got {a.shape} and {b.shape}")
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(np.abs(a).sum(axis=0).max(initial=0.0), 1.0)
    max_iter = 3 * n if max_iter is None else max_iter
    gradient = a.T @ (b - a @ x)
    for _ in range(max_iter):
        free = ~passive & (gradient > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        x = _feasible_step(a, b, x, passive, tol)
        gradient = a.T @ (b - a @ x)
    return x


def _feasible_step(a: np.ndarray, b: np.ndarray, x: np.ndarray, passive: np.ndarray, tol: float) -> np.ndarray:
    """Inner loop: least squares on the passive set, stepping back to the boundary while it goes negative."""
    while True:
        z = np.zeros_like(x)
        z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
        if (z[passive] > tol).all():
            return z
        # Move from x toward z as far as feasibility allows; the blocking variables leave the set.
        blocking = passive & (z <= tol)
        alpha = np.min(x[blocking] / np.maximum(x[blocking] - z[blocking], 1e-300))
        x = x + alpha * (z - x)
        passive &= x > tol
        x[~passive] = 0.0
        if not passive.any():
            return x


def robust_nnls(
    a: np.ndarray,
    b: np.ndarray,
    prior_rows: int = 0,
    huber_iters: int = 8,
    bisquare_iters: int = 8,
    min_scale: float = 1e-12,
) -> tuple[np.ndarray, np.ndarray]:
    """Outlier-robust NNLS; returns ``(x, weights)`` where weight 0 marks a rejected row.

    The last ``prior_rows`` rows are a regulariser, not data: they keep weight 1 and
    take no part in the residual scale. ``min_scale`` floors that scale so noise-free
    data does not divide by zero.
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    data = len(b) - prior_rows
    if data < 1:
        raise ValueError(f"robust_nnls: needs at least one data row, got {len(b)} rows of which {prior_rows} prior")
    weights = np.ones(len(b))
    x = nnls(a, b)
    for weigh, iters in ((_huber, huber_iters), (_bisquare, bisquare_iters)):
        for _ in range(iters):
            r = (b - a @ x)[:data]
            scale = max(_MAD_TO_SIGMA * float(np.median(np.abs(r - np.median(r)))), min_scale)
            weights[:data] = weigh(np.abs(r) / scale)
            sw = np.sqrt(weights)
            x_new = nnls(a * sw[:, None], b * sw)
            converged = np.allclose(x_new, x, rtol=1e-10, atol=0.0)
            x = x_new
            if converged:
                break
    return x, weights


def _huber(u: np.ndarray) -> np.ndarray:
    return np.minimum(1.0, HUBER_K / np.maximum(u, 1e-300))


def _bisquare(u: np.ndarray) -> np.ndarray:
    return np.where(u < BISQUARE_C, (1 - (u / BISQUARE_C) ** 2) ** 2, 0.0)
