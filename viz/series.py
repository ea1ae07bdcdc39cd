"""Scalar series for the curves view: smoothing, thinning and what looks wrong.

A training script logs scalars (`tf.debug.scalar("loss", step, value)`); a long run
logs millions of points, and a terminal plot is ~150 columns wide. Drawing every
point costs seconds (textual-plot took 17 s for 1M points in our measurement) and
shows nothing more, so each series is *thinned* to a min/max envelope of about two
buckets per column, the method of Grafana's and TensorBoard's downsamplers (keep
each bucket's extremes so a spike survives): a million points draw as fast as a
thousand. Smoothing is TensorBoard's debiased exponential moving average, computed
on the full data (never on the thinned points, which would smooth the envelope).

Nothing here imports Textual; the functions take and return numpy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

SPIKE_SIGMAS = 6.0    # a point this many robust sigmas above its neighbourhood is a spike
SHARE = 0.25          # series share a plot only where each spans this much of its height


@dataclass
class Series:
    """One named scalar series as arrays; `bad` holds the steps whose value was
    NaN/Inf (JSON null in the record)."""

    name: str
    steps: np.ndarray
    values: np.ndarray

    @classmethod
    def from_points(cls, name: str, points: list) -> Series:
        """From the record's ``[[step, value], ...]`` (value null = NaN)."""
        if not points:
            return cls(name, np.zeros(0), np.zeros(0))
        steps = np.fromiter((p[0] for p in points), float, len(points))
        values = np.fromiter((np.nan if p[1] is None else p[1] for p in points), float,
                             len(points))
        return cls(name, steps, values)

    # A Series is never changed once built (a live series that grew is a new one),
    # so what a redraw asks of all its points is computed once.

    @cached_property
    def bad_steps(self) -> np.ndarray:
        """Steps whose value is NaN or +-Inf."""
        return self.steps[~np.isfinite(self.values)]

    @cached_property
    def finite_min(self) -> float | None:
        """The smallest finite value (None: there is none)."""
        finite = self.values[np.isfinite(self.values)]
        return float(finite.min()) if len(finite) else None

    @cached_property
    def finite_max(self) -> float | None:
        """The largest finite value (None: there is none)."""
        finite = self.values[np.isfinite(self.values)]
        return float(finite.max()) if len(finite) else None

    def last(self) -> float | None:
        return float(self.values[-1]) if len(self.values) else None


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: an exponential moving average with weight `weight`
    (0 = none, 0.99 = heavy), debiased so the start is not pulled towards zero.
    Non-finite values are skipped (they keep the previous average)."""
    if weight <= 0 or len(values) == 0:
        return values.astype(float)
    out = np.empty(len(values))
    last, count = 0.0, 0
    for k, v in enumerate(values.tolist()):   # a plain loop: 1M points in ~0.3 s
        if np.isfinite(v):
            last = last * weight + (1 - weight) * v
            count += 1
        out[k] = last / (1 - weight ** count) if count else np.nan
    return out


def thin(steps: np.ndarray, values: np.ndarray, columns: int
         ) -> tuple[np.ndarray, np.ndarray]:
    """About ``2 * columns`` points that draw like all of them: the series is cut
    into one bucket per column and each bucket gives its min and max (the line goes
    from one to the other, inside the column). Short series come back unchanged."""
    buckets = max(columns, 1)
    if len(steps) <= 2 * buckets:
        return steps, values
    finite = np.where(np.isfinite(values), values, np.nan)
    edges = np.linspace(0, len(steps), buckets + 1).astype(int)
    starts = edges[:-1]
    filled_low = np.where(np.isnan(finite), np.inf, finite)
    filled_high = np.where(np.isnan(finite), -np.inf, finite)
    low = np.minimum.reduceat(filled_low, starts)
    high = np.maximum.reduceat(filled_high, starts)
    ends = np.maximum(edges[1:] - 1, starts)
    xs = np.column_stack([steps[starts], steps[ends]]).ravel()
    ys = np.column_stack([low, high]).ravel()
    ys[~np.isfinite(ys)] = np.nan   # an all-NaN bucket draws nothing
    return xs, ys


def spikes(values: np.ndarray, window: int = 25) -> np.ndarray:
    """Indexes of points far above their neighbourhood: more than SPIKE_SIGMAS
    robust standard deviations (1.4826 x the median absolute deviation) above the
    rolling median of the previous `window` points. Used to mark loss spikes."""
    n = len(values)
    if n < window + 1:
        return np.zeros(0, dtype=int)
    finite = np.isfinite(values)
    found = []
    # Blocks of `window` points: the median of the block before judges the next one,
    # so the cost is O(n) medians of small arrays, not one per point.
    for start in range(window, n, window):
        before = values[start - window:start]
        before = before[np.isfinite(before)]
        if len(before) < 3:
            continue
        median = float(np.median(before))
        mad = 1.4826 * float(np.median(np.abs(before - median))) or 1e-12
        block = values[start:start + window]
        hits = np.nonzero(np.isfinite(block) & (block - median > SPIKE_SIGMAS * mad))[0]
        found.extend((hits + start).tolist())
    return np.array([k for k in found if finite[k]], dtype=int)


def scale_groups(ranges: list[tuple[str, float | None, float | None]]) -> list[list[str]]:
    """The names of `ranges` ((name, finite min, finite max); None, None: no finite
    value) grouped so that each group can share one plot's y axis, in order.

    On one axis a series is readable only where it spans a good part of the height:
    loss (0.6–2.2) and accuracy (0.90–0.99) drawn together made accuracy a flat line
    at the top. So a series joins the first group in which, with it, every member
    spans at least SHARE of the group's range (train and test loss do); else it
    starts a group, a plot, of its own. A series without a finite value (all NaN)
    is plotted alone.
    """
    groups: list[tuple[list[str], list[tuple[float, float]] | None]] = []
    for name, low, high in ranges:
        span = None if low is None or high is None else (low, high)
        for names, spans in groups:
            if span is not None and spans is not None and _readable(spans + [span]):
                names.append(name)
                spans.append(span)
                break
        else:
            groups.append(([name], None if span is None else [span]))
    return [names for names, _ in groups]


def _readable(spans: list[tuple[float, float]]) -> bool:
    """Whether each of `spans` covers at least SHARE of their joint range."""
    low = min(lo for lo, _ in spans)
    high = max(hi for _, hi in spans)
    if high == low:   # constants of one value
        return True
    return all(hi - lo >= SHARE * (high - low) for lo, hi in spans)
