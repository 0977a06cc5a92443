"""Figures for the docs, drawn from the library itself at build time (a few seconds)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import json  # noqa: E402
import pathlib  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmath import (  # noqa: E402
    HutchEnvelope,
    HutchPPEnvelope,
    PLDAccountant,
    SubsampledGaussian,
)

NOISE_CURVES = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "noise_curves.json"
SAMPLING_CURVES = NOISE_CURVES.with_name("sampling_curves.json")
SCHUR_MAP = NOISE_CURVES.with_name("schur_map.json")


def envelope_overview(path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, d in zip(axes, (2, 2048), strict=True):
        env, pp = HutchEnvelope(32, d), HutchPPEnvelope(32, d)
        x = np.linspace(0.3, 1.6 if d == 2 else 1.15, 800)
        ax.plot(x, env.vertex_cdf(x), ":", label="vertex e: chi2(k)/k")
        ax.plot(x, env.uniform_cdf(x), ":", label="uniform u: chi2(kd)/(kd)")
        ax.plot(x, env.cdf(x), "k-", lw=1.4, label="Hutch envelope")
        ax.plot(x, pp.cdf(x), "r--", lw=1, label="Hutch++ envelope")
        ax.axvline(env.x_plus, color="grey", lw=0.6)
        ax.set_title(f"k = 32, d = {d}  (x_plus = {env.x_plus:.5f})")
        ax.set_xlabel("x")
    axes[0].set_ylabel("F(x)")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def middle_region(path: str) -> None:
    env = HutchEnvelope(32, 2048)
    x = np.linspace(0.9995, env.x_plus + 4e-4, 400)
    F = env.cdf(x)
    base = np.maximum(env.vertex_cdf(x), env.uniform_cdf(x))
    lam = np.array([env.maximizer(v).lam if 1 < v < env.x_plus else np.nan for v in x])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].plot(x - 1, F - base, "k-")
    axes[0].set_title("envelope minus max(vertex, uniform), k = 32, d = 2048", fontsize=9)
    axes[0].axvline(0.0, color="grey", lw=0.6)
    axes[0].axvline(env.x_plus - 1, color="grey", lw=0.6)
    axes[0].set_xlabel("x - 1  (grey: 1 and x_plus)")
    axes[1].plot(x - 1, lam, "k-")
    axes[1].set_title("weight of the heavy coordinate in the maximizer", fontsize=9)
    axes[1].set_xlabel("x - 1")
    for ax in axes:
        ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 3))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def x_plus_vs_formula(path: str) -> None:
    ks, ds = (1, 4, 32), (2, 8, 64, 512)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for k in ks:
        dk = [k * d for d in ds]
        xp = [HutchEnvelope(k, d).x_plus - 1 for d in ds]
        ax.loglog(dk, xp, "o-", label=f"measured, k = {k}")
    grid = np.logspace(0, 4.5, 50)
    ax.loglog(grid, 2 / grid, "k--", label="paper: 2/(dk)")
    ax.set_xlabel("d k")
    ax.set_ylabel("x_plus - 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tradeoff_curves(path: str) -> None:
    """f-DP curves of the Table 4 setting: DP-SGD against DP-SGD-RC with Hutch and Hutch++ at one sigma."""
    q, steps, sigma = 64 / 1139, 180, 4.073
    alpha = np.concatenate([[0.0], np.geomspace(1e-8, 1.0, 300)])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    mechs = [("DP-SGD", SubsampledGaussian(sigma, q)),
             ("DP-SGD-RC, Hutch k=16", SubsampledGaussian(sigma, q, HutchEnvelope(16, 2048))),
             ("DP-SGD-RC, Hutch k=32", SubsampledGaussian(sigma, q, HutchEnvelope(32, 2048))),
             ("DP-SGD-RC, Hutch++ k=32", SubsampledGaussian(sigma, q, HutchPPEnvelope(32, 2048)))]
    base = None
    for color, (name, m) in enumerate(mechs):
        beta = PLDAccountant().compose(m, steps).tradeoff(alpha)
        axes[0].plot(alpha, beta, color=f"C{color}", label=name)
        adv = 1 - beta - alpha
        if base is None:
            base = adv
        else:
            keep = (base > 1e-12) & (alpha > 0)
            axes[1].semilogx(alpha[keep], adv[keep] / base[keep], color=f"C{color}", label=name)
    axes[0].plot([0, 1], [1, 0], "k:", lw=0.7, label="perfect privacy")
    axes[0].set_xlabel("type I error alpha")
    axes[0].set_ylabel("type II error beta (lower bound)")
    axes[0].set_title(f"trade-off curves, sigma = {sigma}, q = 64/1139, {steps} steps", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].set_xlabel("alpha")
    axes[1].set_ylabel("advantage 1 - beta - alpha, relative to DP-SGD")
    axes[1].set_title("what the estimated norms cost, at every alpha", fontsize=9)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def noise_curves(path: str) -> None:
    """sigma against k and d, from benchmarks/noise_curves.py's committed results."""
    res = json.loads(NOISE_CURVES.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, var in ((axes[0], "by_k", "k"), (axes[1], "by_d", "d")):
        block = res[key]
        order = np.argsort(block[var])
        xs = np.asarray(block[var])[order]
        ax.semilogx(xs, np.asarray(block["hutch"])[order], "o-", label="Hutch", base=2)
        ax.semilogx(xs, np.asarray(block["hutchpp"])[order], "s--", label="Hutch++", base=2)
        ax.axhline(res["dpsgd"], color="k", lw=0.8, ls=":", label="DP-SGD")
        ax.set_xlabel(var)
        ax.set_ylabel("noise multiplier sigma")
        other = f"d = {block['d']}" if key == "by_k" else f"k = {block['k']}"
        ax.set_title(f"sigma against {var} ({other}), epsilon = {res['setting']['epsilon']:g}")
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sampling_curves(path: str) -> None:
    """Epsilon against epochs for each batch sampling, from benchmarks/sampling_bench.py's committed results."""
    res = json.loads(SAMPLING_CURVES.read_text())
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, curve in res["curves"].items():
        replace = curve["relation"] == "replace one"
        ax.semilogy(res["epochs"], curve["epsilon"], "s--" if replace else "o-", ms=4,
                    label=f"{name} ({curve['relation']})")
    st = res["setting"]
    ax.set_xlabel("epochs")
    ax.set_ylabel("epsilon (upper end)")
    ax.set_title(f"The same noise, sampled differently: sigma = {st['sigma']:g}, N = {st['N']}, B = {st['B']}, "
                 f"delta = {st['delta']:g}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def schur_map(path: str) -> None:
    """Verdict of check_schur on g_t(lam) = P(X(lam) <= t), from benchmarks/schur_map.py's results."""
    from matplotlib.colors import ListedColormap

    res = json.loads(SCHUR_MAP.read_text())
    codes = {"convex": 0, "neither": 1, "concave": 2, "both": 1}
    labels = [f"k={c['k']}, d={c['d']}" for c in res["cases"].values()]
    grid = np.array([[codes[v] for v in c["verdict"]] for c in res["cases"].values()])
    t = np.asarray(res["t"])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.4))
    cmap = ListedColormap(["#4c72b0", "#dddddd", "#dd8452"])
    step = t[1] - t[0]
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
              extent=(t[0] - step / 2, t[-1] + step / 2, len(labels) - 0.5, -0.5))
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("t")
    ax.axvline(1.0, color="k", lw=0.8, ls=":")
    ax.axvline(2.0, color="k", lw=0.8, ls=":")
    ax.set_title("g_t(lam) = P(X(lam) <= t): blue = no violation as Schur-convex, orange = as Schur-concave, "
                 "grey = both refuted", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def laplace_domination(path: str) -> None:
    """mu(t) / t of the Laplace mechanism's Gaussian domination, and the trade-off curves at t = 1."""
    from scipy import stats

    from dpmath.lap2 import LAPLACE_GDP_FACTOR, laplace_gdp_mu, laplace_tradeoff

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ts = np.geomspace(1e-3, 50, 60)
    axes[0].semilogx(ts, [laplace_gdp_mu(t) / t for t in ts], label="mu(t) / t (smallest mu with G_mu <= f_t)")
    axes[0].axhline(LAPLACE_GDP_FACTOR, color="k", ls=":", lw=0.8, label="sqrt(pi/2)")
    axes[0].axhline(1.0, color="grey", ls="--", lw=0.8, label="1 (central limit of a spread gradient)")
    axes[0].set_xlabel("Laplace shift t = u / b")
    axes[0].legend(fontsize=7)
    alpha = np.linspace(0, 1, 801)
    axes[1].plot(alpha, laplace_tradeoff(alpha, 1.0), label="Laplace f_1")
    for mu, ls in ((laplace_gdp_mu(1.0), "--"), (LAPLACE_GDP_FACTOR, ":")):
        axes[1].plot(alpha, stats.norm.cdf(stats.norm.isf(alpha) - mu), ls, label=f"Gaussian G_{mu:.3f}")
    axes[1].set_xlabel("type I error alpha")
    axes[1].set_ylabel("type II error")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    jobs = {"envelope_overview.png": envelope_overview, "middle_region.png": middle_region,
            "x_plus.png": x_plus_vs_formula, "tradeoff.png": tradeoff_curves, "noise_curves.png": noise_curves,
            "sampling_curves.png": sampling_curves,
            "schur_map.png": schur_map, "laplace_domination.png": laplace_domination}
    for name, fn in jobs.items():
        target = os.path.join(out_dir, name)
        if not os.path.exists(target):
            fn(target)


if __name__ == "__main__":
    main(os.path.join(os.path.dirname(__file__), "..", "_static", "generated"))
