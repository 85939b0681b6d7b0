"""Per-rank step-time model: a fixed cost per step plus a cost per sample, fitted robustly.

Why not samples / seconds: a step of n samples takes t(n) = fixed + n * per_sample (+ a given
cost per micro-batch). On a GPU running a small model the fixed part (kernel launches, the
optimizer, Python) dominates. A throughput n / t(n) then grows with n: the rank given fewer
samples looks slower per sample, gets fewer still, and two identical GPUs drift apart (8:8 ->
2:14 in issue 16). Fitting both terms removes that feedback: identical devices have identical
lines, whatever samples they were last given.

StepTimeFitter keeps this rank's recent observations (n, seconds) and fits the line:

* robustly: iteratively re-weighted least squares with Huber weights, residual scale from the
  median absolute deviation (one-off spikes such as a garbage collection or an allocator growth
  barely move the fit);
* with a weak prior on the slope, per_sample ~ (1 - prior_fixed) * mean_t / mean_n with a
  relative standard deviation of ``prior_spread`` (default 1.0, i.e. 100 %): it decides the
  slope only while every observation has (nearly) the same n, e.g. before the first re-plan,
  and is outweighed by data as soon as n varies;
* physically: fixed >= 0, per_sample >= 0 (a negative intercept from noise is clipped and the
  line passed through the origin and the centroid);
* tracking change: when the last ``shift_after`` (3) observations all sit more than
  ``shift_sigmas`` noise scales (and more than ``shift_min`` = 10 % relative) on the same side
  of the prediction, the device changed speed (another job, clocks) and older observations
  are dropped (the noise scale measured before stays as a floor until the window refills).

The fit carries its uncertainty (StepModel.level_var: variance of the mean time at the
observations' centroid; slope_var), which the Balancer uses to ignore predicted gains that are
within the measurement noise.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StepModel:
    """t(n) = fixed + per_sample * n (+ per_micro * micro-batches, given) seconds for n > 0.

    n_ref, level_var, slope_var, count, noise: the centroid of the observations, the variance
    of the fitted mean time there, the variance of per_sample, the number of observations
    behind the fit (0: a model given, not measured), the residual scale of one observation
    (seconds) and the range of samples per step [n_lo, n_hi] the observations cover (the
    model is trusted near it; the Balancer moves plans outside it gradually)."""
    fixed: float
    per_sample: float
    n_ref: float = 0.0
    level_var: float = 0.0
    slope_var: float = 0.0
    count: int = 0
    noise: float = 0.0
    n_lo: float = 0.0
    n_hi: float = 0.0

    VECTOR_LEN = 9

    def time(self, n: float) -> float:
        return 0.0 if n <= 0 else self.fixed + self.per_sample * n

    def level_se(self) -> float:
        return math.sqrt(max(self.level_var, 0.0))

    def se(self, n: float) -> float:
        """Standard error of time(n) (level at the centroid plus the slope's extrapolation)."""
        return math.sqrt(max(self.level_var + (n - self.n_ref) ** 2 * self.slope_var, 0.0))

    @property
    def speed(self) -> float:
        """Marginal samples/s (1 / per_sample)."""
        return 1.0 / self.per_sample if self.per_sample > 0 else math.inf

    def throughput(self, n: float) -> float:
        """Samples/s at n samples per step, fixed cost included."""
        t = self.time(n)
        return n / t if t > 0 else math.inf

    @classmethod
    def from_speed(cls, speed: float) -> "StepModel":
        """Pure per-sample model of a throughput (samples/s): no fixed cost, no uncertainty."""
        return cls(fixed=0.0, per_sample=1.0 / speed if speed > 0 else math.inf)

    def to_vector(self) -> list[float]:
        return [self.fixed, self.per_sample, self.n_ref, self.level_var, self.slope_var,
                float(self.count), self.noise, self.n_lo, self.n_hi]

    @classmethod
    def from_vector(cls, v: Sequence[float]) -> "StepModel | None":
        """Inverse of to_vector; None for the all-zero vector ("no model")."""
        v = [float(x) for x in v]
        if len(v) != cls.VECTOR_LEN:
            raise ValueError(f"StepModel vector has {len(v)} entries, not {cls.VECTOR_LEN}")
        if not any(v) or any(math.isnan(x) for x in v):
            return None
        return cls(fixed=v[0], per_sample=v[1], n_ref=v[2], level_var=v[3], slope_var=v[4],
                   count=int(round(v[5])), noise=v[6], n_lo=v[7], n_hi=v[8])

    def __str__(self) -> str:
        return (f"StepModel(fixed={self.fixed * 1e3:.3g} ms, per_sample={self.per_sample * 1e3:.3g}"
                f" ms, n_ref={self.n_ref:.3g}, se={self.level_se() * 1e3:.2g} ms, "
                f"count={self.count})")


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    k = len(s)
    if k == 0:
        return 0.0
    return s[k // 2] if k % 2 else 0.5 * (s[k // 2 - 1] + s[k // 2])


def fit_line(ns: Sequence[float], ts: Sequence[float], *, prior_fixed: float = 0.0,
             prior_spread: float = 1.0, noise_floor: float = 0.005, noise_prior: float = 0.05,
             iters: int = 8, huber: float = 1.345) -> StepModel | None:
    """Robust fit of t = fixed + per_sample * n (module docstring). None without data."""
    obs = [(float(n), float(t)) for n, t in zip(ns, ts)
           if n > 0 and t > 0 and math.isfinite(t)]
    N = len(obs)
    if N == 0:
        return None
    # robust start: a line through the medians of each distinct n (weighted by their counts),
    # so that a few huge outliers cannot set the initial residual scale
    groups: dict[float, list[float]] = {}
    for n, t in obs:
        groups.setdefault(n, []).append(t)
    gn = sorted(groups)
    gm = [_median(groups[n]) for n in gn]
    gw = [len(groups[n]) for n in gn]
    gsw = float(sum(gw))
    g_nbar = sum(w_ * n for w_, n in zip(gw, gn)) / gsw
    g_ybar = sum(w_ * y for w_, y in zip(gw, gm)) / gsw
    g_sxx = sum(w_ * (n - g_nbar) ** 2 for w_, n in zip(gw, gn))
    if g_sxx > 0:
        b = max(0.0, sum(w_ * (n - g_nbar) * (y - g_ybar) for w_, n, y in zip(gw, gn, gm)) / g_sxx)
    else:
        b = max((1.0 - prior_fixed) * g_ybar / g_nbar, 0.0)
    a = g_ybar - b * g_nbar
    if a < 0:
        a, b = 0.0, g_ybar / g_nbar
    mad = 1.4826 * _median([abs(t - (a + b * n)) for n, t in obs])
    scale0 = max(mad, noise_floor * g_ybar, (noise_prior * g_ybar) if N < 4 else 0.0)
    w = [1.0 if abs(t - (a + b * n)) <= huber * scale0 else huber * scale0 / abs(t - (a + b * n))
         for n, t in obs]
    sigma = scale0
    nbar = ybar = 0.0
    var_b = 0.0
    for it in range(iters):
        sw = sum(w)
        nbar = sum(wi * n for wi, (n, _) in zip(w, obs)) / sw
        ybar = sum(wi * t for wi, (_, t) in zip(w, obs)) / sw
        sxx = sum(wi * (n - nbar) ** 2 for wi, (n, _) in zip(w, obs))
        sxy = sum(wi * (n - nbar) * (t - ybar) for wi, (n, t) in zip(w, obs))
        # noise scale: MAD of the current residuals, floored (relative) and, with few
        # observations, no smaller than noise_prior (a scale from 1-3 points means nothing)
        mad = 1.4826 * _median([abs(t - (a + b * n)) for n, t in obs])
        sigma = max(mad, noise_floor * ybar)
        if N < 4:
            sigma = max(sigma, noise_prior * ybar)
        bp = max((1.0 - prior_fixed) * ybar / nbar, 0.0)
        prior_prec = 1.0 / (prior_spread * bp) ** 2 if bp > 0 and prior_spread > 0 else 0.0
        data_prec = sxx / sigma ** 2
        prec = data_prec + prior_prec
        if prec > 0:
            b = (sxy / sigma ** 2 + bp * prior_prec) / prec
            var_b = 1.0 / prec
        else:
            b, var_b = bp, 0.0
        b = max(b, 0.0)
        a = ybar - b * nbar
        if a < 0:
            a, b = 0.0, ybar / nbar
        resid = [t - (a + b * n) for n, t in obs]
        w_new = [1.0 if abs(r) <= huber * sigma else huber * sigma / abs(r) for r in resid]
        if max(abs(x - y) for x, y in zip(w, w_new)) < 1e-6:
            w = w_new
            break
        w = w_new
    sw = sum(w)
    # effective number of observations behind the mean (weights <= 1)
    return StepModel(fixed=a, per_sample=b, n_ref=nbar, level_var=sigma ** 2 / sw,
                     slope_var=var_b, count=N, noise=sigma, n_lo=min(n for n, _ in obs),
                     n_hi=max(n for n, _ in obs))


class StepTimeFitter:
    """Window of this rank's (samples, seconds) observations and their robust fit.

    add(n, seconds, micro=0) records one step (``per_micro * micro`` seconds are subtracted:
    a known cost per micro-batch, by default 0); model() returns the current StepModel (None
    before the first observation with n > 0)."""

    def __init__(self, window: int = 32, *, prior_fixed: float = 0.0, prior_spread: float = 1.0,
                 noise_floor: float = 0.005, shift_sigmas: float = 4.0, shift_min: float = 0.1,
                 shift_after: int = 3, per_micro: float = 0.0):
        if window < 2:
            raise ValueError("window must be >= 2")
        if not 0.0 <= prior_fixed < 1.0:
            raise ValueError("prior_fixed must be in [0, 1)")
        self.window = int(window)
        self.prior_fixed, self.prior_spread = float(prior_fixed), float(prior_spread)
        self.noise_floor = float(noise_floor)
        self.shift_sigmas, self.shift_min = float(shift_sigmas), float(shift_min)
        self.shift_after = max(1, int(shift_after))
        self.per_micro = float(per_micro)
        self.obs: deque[tuple[float, float]] = deque(maxlen=self.window)
        self._model: StepModel | None = None
        self._run: list[int] = []          # signs of the latest consecutive outliers
        self._noise_rel = 0.0              # relative noise before the last shift (floor after)
        self.shifts = 0                    # times a speed change was detected

    def reset(self) -> None:
        self.obs.clear()
        self._model = None
        self._run = []

    def add(self, n: int, seconds: float, micro: int = 0) -> None:
        if n <= 0 or not (seconds > 0) or not math.isfinite(seconds):
            return
        t = seconds - self.per_micro * micro
        if t <= 0:
            t = seconds * 1e-3
        m = self._model
        if m is not None and m.count >= 4:
            pred = m.time(n)
            sigma = math.sqrt(m.noise ** 2 + m.se(n) ** 2)
            dev = t - pred
            if abs(dev) > max(self.shift_sigmas * sigma, self.shift_min * pred):
                sign = 1 if dev > 0 else -1
                self._run = [s for s in self._run if s == sign] + [sign]
            else:
                self._run = []
        self.obs.append((float(n), t))
        if len(self._run) >= self.shift_after:
            keep = list(self.obs)[-len(self._run):]
            self.obs.clear()
            self.obs.extend(keep)
            self._run = []
            self.shifts += 1
            if m is not None and m.time(m.n_ref) > 0:
                # the few observations after a shift say little about the noise: keep the
                # relative noise measured before as a floor until the window refills
                self._noise_rel = m.noise / m.time(m.n_ref)
        floor = self.noise_floor
        if self._noise_rel and len(self.obs) < self.window // 2:
            floor = max(floor, self._noise_rel)
        self._model = fit_line([o[0] for o in self.obs], [o[1] for o in self.obs],
                               prior_fixed=self.prior_fixed, prior_spread=self.prior_spread,
                               noise_floor=floor)

    def model(self) -> StepModel | None:
        return self._model

    def __len__(self) -> int:
        return len(self.obs)
