"""What ``cascade calibrate`` shows: the table of signals (and random routing) on the held-out
prompts, and the plot of quality kept against escalation rate."""

from __future__ import annotations

from pathlib import Path

from cascade.eval.calibration import SignalResult


def plot(results: list[SignalResult], q_edge: float, q_cloud: float, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    scale = 100 / q_cloud if q_cloud else 100.0  # a cloud that got nothing right: the raw quality
    for r in results:
        xs, ys = zip(*r.points, strict=True)
        ax.plot([100 * x for x in xs], [scale * y for y in ys], label=f"{r.name} (APGR {r.apgr:.2f})")
    ax.plot([0, 100], [scale * q_edge, scale * q_cloud], "--", color="grey", label="random routing (APGR 0.50)")
    ax.axvline(100 * target, color="black", lw=0.8, ls=":")
    ax.axhline(90, color="red", lw=0.6, ls=":")
    ax.set_xlabel("escalated to the cloud (%)")
    ax.set_ylabel("quality kept (% of cloud-only)")
    ax.set_title("Cascade calibration, held-out prompts")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)



def print_results(results: list[SignalResult], best: SignalResult, q_e: float, q_c: float, target: float) -> None:
    """Held-out quality of each tier alone, then each signal's threshold, escalation rate, quality
    kept and APGR (the one written marked), and random routing at the target rate."""
    print(f"held-out quality: edge only {q_e:.3f}, cloud only {q_c:.3f} (edge keeps {q_e / q_c:.1%} alone)"
          if q_c else f"held-out quality: edge only {q_e:.3f}, cloud only {q_c:.3f}")
    print(f"{'signal':12s} {'threshold':>10s} {'escalated':>10s} {'quality kept':>13s} {'APGR':>6s}")
    for r in results:
        print(f"{r.name:12s} {r.threshold:10.4f} {r.escalation:10.1%} {r.quality_kept:13.1%} {r.apgr:6.3f}"
              f"{'  <- written' if r is best else ''}")
    random_kept = (q_e + target * (q_c - q_e)) / q_c if q_c else float("nan")
    print(f"{'random':12s} {'':>10s} {target:10.1%} {random_kept:13.1%} {0.5:6.3f}")
