"""The memory-saving paths give the numbers of the plain ones: octave bands placed a block of rows at a time, the
unamplified fallback on a coarser grid embedded into the finer one, and the read-out computed in place."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import signal

from dpmath import Gaussian
from dpmath.pld import allocation, steps
from dpmath.pld.distribution import Pld


@pytest.mark.parametrize("relation", ["remove", "add"])
def test_octave_bands_placed_in_small_blocks_are_bit_identical(monkeypatch, relation):
    mu, t = 1 / 0.35, 20
    cap = math.exp(0.5 * mu * mu + 7.65 * mu) if relation == "remove" else t * math.exp(3.0)
    build = allocation.band_laws.__wrapped__   # not the cached laws: the second build must run again
    shape, unit = (30, (1 << 12) + 1), 2.0 ** -20
    terms = [allocation._band_term(mu, False, unit, shape, up, up) for up in (True, False)]
    whole = build(mu, t, relation, cap, allocation._BAND_TRY)
    assert whole.upper.mass.shape[1] > 1 << 11   # rows of 2^12 + 1 points or more: below, each row is a block
    monkeypatch.setattr(allocation, "_PLACE_BLOCK", 1 << 11)
    # one term: each point's mass placed once, so the same floats
    for a, up in zip(terms, (True, False), strict=True):
        b = allocation._band_term(mu, False, unit, shape, up, up)
        assert np.array_equal(a.mass, b.mass) and a.inf == b.inf
    # the sums: where blocks meet, masses that share a point add in another order, and a tilt chosen on a tail sum
    # one rounding apart moves a far tail's error bound (adding: by 1.3e-6 of the top row's masses near 6e-20)
    blocks = build(mu, t, relation, cap, allocation._BAND_TRY)
    for a, b in ((whole.upper, blocks.upper), (whole.lower, blocks.lower)):
        assert a.unit == b.unit and a.mass.shape == b.mass.shape
        np.testing.assert_allclose(a.mass, b.mass, rtol=1e-5, atol=1e-300)
        assert a.inf == pytest.approx(b.inf, rel=1e-12, abs=1e-300)


def test_a_coarse_gaussian_embedded_in_the_finer_grid_reads_the_same_curve():
    h = 1e-4
    coarse, f = steps._coarse_gaussian(Gaussian(0.05), h)   # mu = 20: 3.8M points on h, at most 2^19 on h f
    assert f > 1 and coarse.pmf.size <= (1 << 19) + 2
    fine = steps._embedded(coarse, f)
    assert fine.h == h and fine.pmf.size == (coarse.pmf.size - 1) * f + 1
    # the same law; only the read-out's rounding allowance (5 eps per point of the grid) differs: 3.5M points
    for eps in (150.0, 200.0, 250.0, 280.0):
        assert fine.delta(eps) == pytest.approx(coarse.delta(eps), rel=1e-8)
    assert fine.epsilon(1e-5) == pytest.approx(coarse.epsilon(1e-5), rel=1e-8)
    # an upper bound: at least the exact Gaussian's epsilon (284.39184949774 at 1e-5)
    assert fine.epsilon(1e-5) >= 284.3918494977


@pytest.mark.parametrize("upper", [True, False])
def test_the_read_out_in_place_is_the_plain_formula_bit_for_bit(upper):
    rng = np.random.default_rng(5)
    pmf = rng.random(20_001)
    pmf /= 1.3 * pmf.sum()
    pld = Pld(1e-4, -700, pmf, 0.01, upper, slack=0.0 if upper else 1e-9)
    t, dj, r, total = pld._curves()
    eps, side, c, n = float(np.finfo(np.float64).eps), 1.0 if upper else -1.0, math.exp(-pld.h), pmf.size
    r0 = signal.lfilter([0.0, c], [1.0, -c], pmf[::-1])[::-1]
    rel = (5.0 * eps) * (n + 1 - np.arange(n, dtype=np.float64))
    d = math.expm1(pld.h) * np.cumsum(r0[::-1])[::-1] * (1.0 + side * rel)
    dj0 = pld.inf + d - pld.slack
    dj0 = np.clip(dj0 + side * (2.0 * eps) * (pld.inf + d + pld.slack), 0.0, 1.0)
    assert np.array_equal(dj, dj0)
    assert np.array_equal(r, r0 * (1.0 - side * rel))
    assert np.array_equal(t.array(), (pld.start + np.arange(n)) * pld.h)
    assert t[7] == (pld.start + 7) * pld.h and np.array_equal(t[np.array([0, 5])], t.array()[[0, 5]])


_PLANS = """
import sys
import numpy as np
from scipy import fft as sfft
from dpmath.pld.compose import fft_plan

def resident():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

lengths = [sfft.next_fast_len((1 << 21) + 40_000 * i, real=True) for i in range(8)]
fft_plan(1 << 20, np.float64)   # a large length planned before: the next new one empties the cache
sfft.rfft(np.ones(1 << 20))
base = resident()
for n in lengths:
    if sys.argv[1] == "plan":
        fft_plan(n, np.float64)
    sfft.irfft(sfft.rfft(np.ones(n)), n)
print(resident() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the resident size from /proc")
def test_large_fft_plans_of_other_lengths_are_not_kept():
    # pocketfft keeps the plans of its last 16 lengths a precision, 8 to 16 bytes a point each: eight lengths near
    # 2^21 kept about 150 MB; with fft_plan before each transform one large plan is left (about 16 MB).  Each run in
    # a new process: one that has freed much memory keeps some of it, whatever the plans
    grown = {}
    for mode in ("plan", "keep"):
        out = subprocess.run([sys.executable, "-c", _PLANS, mode], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[2])
        grown[mode] = float(out.stdout.split()[-1])
    assert grown["plan"] < 60.0 < grown["plan"] + 60.0 < grown["keep"]


@pytest.mark.parametrize("shared", [False, True])
def test_a_pass_taking_its_powers_in_place_leaves_the_shared_transforms_as_they_were(shared):
    # a two-point step: no frequency's modulus is small, so every one is kept and the powers are taken in place,
    # on the pass's own transforms only; a shared one is reused at other counts
    from dpmath.pld.compose import Composition, Spectra, tilted_product

    step = Pld(0.1, -3, np.array([0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7]), 0.0, True)
    comp = Composition([(step, 5)], 1e-18)
    spectra = Spectra(comp.hi - comp.lo + 1) if shared else None
    first = tilted_product(comp.factors, 0.0, comp.lo, comp.hi, comp.lo, comp.hi, comp.h, spectra=spectra)
    kept = [x.copy() for x, _, _ in spectra.transforms.values()] if shared else []
    again = tilted_product(comp.factors, 0.0, comp.lo, comp.hi, comp.lo, comp.hi, comp.h, spectra=spectra)
    if shared:
        now = [x for x, _, _ in spectra.transforms.values()]
        assert len(now) == len(kept) == 1 and np.array_equal(now[0], kept[0])
    assert first[0] == again[0] and np.array_equal(first[1], again[1]) and np.array_equal(first[2], again[2])
    # five copies of 0.3 at -0.3 and 0.7 at +0.3: the binomial masses
    masses = {round(-1.5 + 0.6 * j, 6): math.comb(5, j) * 0.7**j * 0.3 ** (5 - j) for j in range(6)}
    values = dict(zip(np.round((first[0] + np.arange(first[1].size)) * comp.h, 6), first[1], strict=True))
    for x, m in masses.items():
        assert values[x] == pytest.approx(m, rel=1e-9)
