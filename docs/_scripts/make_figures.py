"""Figures for the docs, drawn from the library itself at build time (a few seconds)."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmath import HutchEnvelope, HutchPPEnvelope  # noqa: E402


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


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    jobs = {"envelope_overview.png": envelope_overview, "middle_region.png": middle_region,
            "x_plus.png": x_plus_vs_formula}
    for name, fn in jobs.items():
        target = os.path.join(out_dir, name)
        if not os.path.exists(target):
            fn(target)


if __name__ == "__main__":
    main(os.path.join(os.path.dirname(__file__), "..", "_static", "generated"))
