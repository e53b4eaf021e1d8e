"""Running sums for a least-squares line, shared by the two cost models that fit one online
(``kpolicy``: verify seconds against K; ``budget``: a batched forward's seconds against rows)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LineSums:
    """Sums over the points ``(x, y)`` added, for the line ``y = intercept + slope x``."""

    n: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> None:
        """Fold one point in."""
        self.n += 1
        self.sx += x
        self.sxx += x * x
        self.sy += y
        self.sxy += x * y
        self.syy += y * y

    @property
    def spread(self) -> float:
        """``n^2`` times the variance of the x values (0 while they are all equal)."""
        return self.n * self.sxx - self.sx * self.sx

    def line(self) -> tuple[float, float]:
        """``(intercept, slope)`` of the least-squares line; needs ``spread > 0``."""
        slope = (self.n * self.sxy - self.sx * self.sy) / self.spread
        return (self.sy - slope * self.sx) / self.n, slope

    def residual(self) -> float:
        """The least-squares line's sum of squared residuals (needs ``spread > 0``)."""
        sxy = self.sxy - self.sx * self.sy / self.n
        syy = self.syy - self.sy * self.sy / self.n
        return max(0.0, syy - sxy * sxy / (self.spread / self.n))
