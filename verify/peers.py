r"""Cross-checks of :class:`dpmath.PLDAccountant` against the peer accountants, when they are installed.

dp_accounting (Google) and prv_accountant (Microsoft, Gopi et al. 2021) are optional: this module imports
them only inside :func:`peer_audit` and skips what is missing (the verify, peers and test extras install
both).

On the subsampled Gaussian, for each configuration ``(sigma, q, steps, delta)``:

* dp_accounting's PLD accountant at the same discretization (1e-4, connect-the-dots): our upper bound must
  agree within 0.5 % (both are the same kind of computation; a larger gap means one of them is wrong), or lie
  further below it with our own bracket narrower than 0.5 % (:func:`agrees_with_dp_accounting`: the default
  bracket refines its grid, so where epsilon is tiny against the grid's step, 0.017 at ``(5, 1e-3, 1000, 1e-5)``,
  dp_accounting's value at 1e-4 is 2 % above the truth and ours is not);
* prv_accountant's certified lower end (``eps_error`` 0.01): our upper bound must not be below it (an upper
  bound below a peer's certified lower bound would be unsound).  Where prv's own bracket excludes the value
  both PLD accountants agree on, the row says so (the known case ``(0.9, 0.1, 3000, 1e-5)``: prv
  ``[65.309, 65.333]``, dp_accounting and ours 65.2585).

:func:`referee_audit` needs no peer: on each configuration our ``[lower, upper]`` must hold the true epsilon
as :mod:`dpmath.referee` encloses it (Laplace inversion with error bounds, no loss grid); it settles the
disagreement above (the truth is 65.2585165) and the one at ``(0.6, 0.01, 100000, 1e-8)``.  It also checks one
DP-SGD-RC step against :func:`dpmath.referee.referee_rc_epsilon` (closed-form curves on scale bins).
"""

from __future__ import annotations

from .result import INSTALL, AuditResult, progress

__all__ = ["PEER_CONFIGS", "QUICK_PEER_CONFIGS", "REFEREE_CONFIGS", "REFEREE_RC_CONFIGS", "peer_audit", "referee_audit",
           "dp_accounting_epsilon", "prv_bracket", "agrees_with_dp_accounting"]

REFEREE_CONFIGS = [
    (4.073, 64 / 1150, 180, 1e-5),
    (1.5, 0.05, 1000, 1e-6),
    (0.9, 0.1, 3000, 1e-5),
    (1.1, 256 / 60000, 14063, 1e-5),
    (0.8, 1e-3, 50000, 1e-6),
    (0.6, 0.01, 100000, 1e-8),
    (2.0, 1e-3, 1000000, 1e-9),
]
"""``(sigma, q, steps, delta)`` refereed by :func:`referee_audit` (issue 16's configurations and the prv
disagreements); the quick run takes the first three."""

REFEREE_RC_CONFIGS = [
    (32, 2048, 1.0, 0.05, 1e-6),
    (8, 200, 0.8, 0.3, 1e-8),
    (4, 8, 3.0, 0.1, 1e-6),
]
"""``(k, d, sigma, q, delta)``: one DP-SGD-RC step with Hutch's envelope, refereed by :func:`referee_audit`
(issue 16's one-step cases); the quick run takes the first."""

PEER_CONFIGS = [
    (0.8, 0.001, 100, 1e-6),
    (5.0, 0.001, 1000, 1e-5),
    (2.0, 0.001, 50000, 1e-10),
    (0.8, 0.001, 50000, 1e-6),
    (1.0, 0.004, 14040, 1e-5),
    (1.1, 256 / 60000, 14063, 1e-5),
    (1.3, 150 / 60000, 6000, 1e-5),
    (4.0, 0.01, 1000, 1e-8),
    (1.0, 0.01, 10000, 1e-10),
    (1.5, 0.04, 2250, 1e-5),
    (1.5, 0.05, 1000, 1e-6),
    (3.0, 0.2, 100, 1e-6),
    (0.7, 0.05, 500, 1e-7),
    (1.5, 0.05, 50000, 1e-6),
    (0.9, 0.1, 3000, 1e-5),
    (2.0, 0.5, 10, 1e-9),
    (10.0, 0.5, 1000, 1e-5),
    (1.0, 1.0, 1, 1e-5),
    (50.0, 1.0, 1, 1e-5),
    (5.0, 1.0, 100, 1e-10),
    (20.0, 1.0, 10000, 1e-8),
    (0.5, 1.0, 5, 1e-6),
    (2.0, 0.3, 5000, 1e-5),
]
"""``(sigma, q, steps, delta)``: epsilon from about 0.1 to 70, q from 1e-3 to 1, steps from 1 to 50,000, delta from
1e-5 to 1e-10 (shared by tests/dpmath/test_peers.py and benchmarks/accountant_bench.py)."""

QUICK_PEER_CONFIGS = [PEER_CONFIGS[i] for i in (0, 7, 10, 11, 15)]
"""A fast subset for ``python -m verify --quick``."""


def dp_accounting_epsilon(sigma: float, q: float, steps: int, delta: float, h: float = 1e-4) -> float:
    """dp_accounting's PLD epsilon of ``steps`` Poisson-subsampled Gaussian steps (discretization ``h``)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=h)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps))
    return float(acc.get_epsilon(delta))


def prv_bracket(sigma: float, q: float, steps: int, delta: float) -> tuple[float, float]:
    """prv_accountant's ``(lower, upper)`` epsilon at ``eps_error = 0.01``."""
    import prv_accountant

    acc = prv_accountant.Accountant(noise_multiplier=sigma, sampling_probability=q, delta=delta, eps_error=0.01,
                                    max_compositions=steps)
    low, _, up = acc.compute_epsilon(num_compositions=steps)
    return float(low), float(up)


def peer_audit(configs: list[tuple[float, float, int, float]] | None = None, use_prv: bool = True) -> AuditResult:
    """Our PLD upper bound against dp_accounting and prv_accountant (a check; skipped where not installed).

    Parameters
    ----------
    configs : list of tuple, optional
        ``(sigma, q, steps, delta)`` tuples; defaults to :data:`QUICK_PEER_CONFIGS`.
    use_prv : bool
        Also run prv_accountant (slow for many steps; configurations with ``steps > 20000`` or ``q = 1`` skip it).

    Returns
    -------
    AuditResult

    Examples
    --------
    >>> from verify.peers import peer_audit
    >>> peer_audit(configs=[(1.0, 0.01, 100, 1e-5)]).holds
    True
    """
    import importlib.util

    from dpmath import PLDAccountant, SubsampledGaussian

    have_dp = importlib.util.find_spec("dp_accounting") is not None
    have_prv = use_prv and importlib.util.find_spec("prv_accountant") is not None
    if not have_dp and not have_prv:
        why = f"needs dp_accounting or prv_accountant, neither of which is installed: {INSTALL}"
        return AuditResult("peers", "check", True, f"skipped: {why}", skipped=why)
    rows = []
    for sigma, q, steps, delta in progress(configs or QUICK_PEER_CONFIGS, "peers"):
        lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon_bracket(delta)
        row = {"sigma, q, steps, delta": f"{sigma:g}, {q:.4g}, {steps}, {delta:g}", "ours [lower, upper]":
               f"[{lo:.5f}, {hi:.5f}]"}
        ok = True
        if have_dp:
            ref = dp_accounting_epsilon(sigma, q, steps, delta)
            row["dp_accounting"] = f"{ref:.5f}" + (" (below our lower end: below the truth)" if ref < lo else "")
            ok &= agrees_with_dp_accounting(lo, hi, ref)
        if have_prv and steps <= 20000 and q < 1:
            try:
                low, up = prv_bracket(sigma, q, steps, delta)
            except (ValueError, RuntimeError) as err:  # prv refuses some regimes
                row["prv [lower, upper]"] = f"refused: {str(err)[:40]}"
            else:
                row["prv [lower, upper]"] = f"[{low:.5f}, {up:.5f}]" + (" (excludes the PLD value)" if hi < low
                                                                        and have_dp and abs(hi - ref) < 1e-4 * ref
                                                                        else "")
                ok &= hi >= low or (have_dp and abs(hi - ref) < 1e-4 * ref)
        row["holds"] = bool(ok)
        rows.append(row)
    peers = " and ".join(n for n, h in (("dp_accounting", have_dp), ("prv_accountant", have_prv)) if h)
    holds = all(r["holds"] for r in rows)
    below = sum("below the truth" in r.get("dp_accounting", "") for r in rows)
    return AuditResult("peers", "check", holds,
                       f"{sum(r['holds'] for r in rows)} of {len(rows)} configurations agree with {peers} "
                       "(within 0.5 % of dp_accounting; never below prv's certified lower end)"
                       + (f"; dp_accounting below the truth (below our certified lower end) in {below}" if below
                          else ""), rows)


def agrees_with_dp_accounting(lower: float, upper: float, reference: float, rtol: float = 5e-3) -> bool:
    """Whether our bracket ``[lower, upper]`` agrees with dp_accounting's pessimistic ``reference``: the upper end
    within ``rtol`` of it, or below it with a bracket narrower than ``rtol`` (ours resolved the truth more finely
    than its grid; an upper end far above it is never accepted), or the reference below our lower end: the truth is
    at least our lower end, so the peer's "pessimistic" value is below the truth (reported as a finding about the
    peer, see :func:`peer_audit`).

    Examples
    --------
    >>> agrees_with_dp_accounting(0.0166434, 0.0166479, 0.0170159), agrees_with_dp_accounting(1.0, 1.2, 1.1)
    (True, False)
    >>> agrees_with_dp_accounting(29.389, 29.391, 28.98)   # dp_accounting below the truth at sigma 0.3, q 1e-4
    True
    """
    if abs(upper - reference) <= rtol * reference:
        return True
    if reference < lower:   # the peer is below our certified lower end, so below the truth: a finding about it
        return True
    return upper < reference and upper - lower <= rtol * upper


def referee_audit(configs: list[tuple[float, float, int, float]] | None = None,
                  rc_configs: list[tuple[int, int, float, float, float]] | None = None) -> AuditResult:
    """Our PLD bracket against the referee's enclosure of the true epsilon (a check; no peer needed).

    Parameters
    ----------
    configs : list of tuple, optional
        ``(sigma, q, steps, delta)`` of DP-SGD; defaults to the first three of :data:`REFEREE_CONFIGS`.
    rc_configs : list of tuple, optional
        ``(k, d, sigma, q, delta)`` of one DP-SGD-RC step with Hutch (:func:`dpmath.referee.referee_rc_epsilon`);
        defaults to the first of :data:`REFEREE_RC_CONFIGS`.

    Returns
    -------
    AuditResult
        One row per configuration: the referee's ``[low, high]``, our bracket on the default grid, and how far
        our upper end lies above the truth.

    Examples
    --------
    >>> from verify.peers import referee_audit
    >>> referee_audit([(4.073, 64 / 1150, 180, 1e-5)]).holds
    True
    """
    from dpmath import HutchEnvelope, PLDAccountant, SubsampledGaussian
    from dpmath.referee import referee_epsilon, referee_rc_epsilon

    def row(name: str, lo: float, hi: float, r_lo: float, r_hi: float) -> dict:
        return {"mechanism; sigma, q, steps, delta": name, "referee [low, high]": f"[{r_lo:.8f}, {r_hi:.8f}]",
                "ours [lower, upper]": f"[{lo:.5f}, {hi:.5f}]",
                "upper above the truth": f"{(hi - r_lo) / r_lo:.1e}", "holds": bool(lo <= r_hi and r_lo <= hi)}

    rows = []
    for sigma, q, steps, delta in progress(configs or REFEREE_CONFIGS[:3], "referee"):
        lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q), steps).epsilon_bracket(delta)
        r_lo, r_hi = referee_epsilon([(sigma, q, steps)], delta, guess=hi)
        rows.append(row(f"DP-SGD; {sigma:g}, {q:.4g}, {steps}, {delta:g}", lo, hi, r_lo, r_hi))
    for k, d, sigma, q, delta in progress(rc_configs or REFEREE_RC_CONFIGS[:1], "referee, randomized clipping"):
        env = HutchEnvelope(k, d)
        lo, hi = PLDAccountant().compose(SubsampledGaussian(sigma, q, env)).epsilon_bracket(delta)
        r_lo, r_hi = referee_rc_epsilon(sigma, q, env, 1, delta)
        rows.append(row(f"RC Hutch k={k}, d={d}; {sigma:g}, {q:g}, 1, {delta:g}", lo, hi, r_lo, r_hi))
    holds = all(r["holds"] for r in rows)
    return AuditResult("referee", "check", holds,
                       f"{sum(r['holds'] for r in rows)} of {len(rows)} PLD brackets hold the true epsilon as the "
                       f"referee (Laplace inversion with error bounds) encloses it", rows)
