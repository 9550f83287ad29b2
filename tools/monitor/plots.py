"""Server-side plots of the swarm's history (matplotlib, Agg backend): PNG bytes, no display.

Rendering takes tens of milliseconds, so the monitor runs it on one worker thread (matplotlib's
pyplot state is not thread-safe; one thread keeps it simple) and caches each plot per poll.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # headless; must precede pyplot's import

from matplotlib.figure import Figure  # noqa: E402

from phalanx.tools.health_client import swarm_metric  # noqa: E402
from phalanx.tools.monitor.history import STATES, SwarmHistory  # noqa: E402

PLOTS = {
    "loss": ("Training loss (last minibatch)", "loss"),
    "evaluation": ("Evaluation (the task's metric)", None),  # test accuracy, or validation loss
    "throughput": ("Throughput (samples/s)", "samples_per_s"),
    "states": ("Trainers by state", None),
}
_COLORS = {"joining": "#e0a800", "online": "#2e9d4e", "offline": "#9e9e9e"}


def render_plot(kind: str, history: SwarmHistory) -> bytes:
    """PNG of one plot; a plot without data yet says so (it is still a valid image)."""
    title, field = PLOTS[kind]
    if kind == "evaluation":  # of the trainers' task's metric
        metric = swarm_metric(r.metric for r in history.latest.values() if r.role == "trainer")
        title, field = metric.label.capitalize(), "accuracy" if metric.key == "accuracy" else "eval_loss"
    fig = Figure(figsize=(6.4, 3.2), dpi=90)  # a bare Figure: no pyplot global state
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel("seconds since the monitor started")
    ax.grid(True, alpha=0.3)
    t0 = history.start
    drawn = False
    if field is not None:
        for peer, (times, values) in sorted(history.series(field).items()):
            ax.plot([t - t0 for t in times], values, label=peer[-8:], linewidth=1.2)
            drawn = True
        if kind == "loss" and drawn:
            ax.set_yscale("log")
        if field == "accuracy":
            ax.set_ylim(0, 1)
    else:
        times, counts = history.states()
        if times:
            ax.stackplot(
                [t - t0 for t in times],
                *(counts[s] for s in STATES),
                labels=STATES,
                colors=[_COLORS[s] for s in STATES],
                step="post",
            )
            ax.yaxis.get_major_locator().set_params(integer=True)
            drawn = True
    if drawn:
        ax.legend(loc="upper left", fontsize="small", ncols=2)
    else:
        ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()
