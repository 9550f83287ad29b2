"""The dashboard page: one HTML document, rendered on the server so it works without scripts;
a small script then refreshes the table and swaps in new plots (preloaded off-screen, so an
image never shows half-loaded)."""

from __future__ import annotations

import html

from phalanx.tasks.metric import Metric
from phalanx.tools.health_client import PeerRow, swarm_metric
from phalanx.tools.monitor.plots import PLOTS

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } code { background: #f3f3f3; padding: 0 .3em; }
table { border-collapse: collapse; font-size: .9em; }
th, td { border-bottom: 1px solid #ddd; padding: .3em .6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.online { color: #2e9d4e; } .joining { color: #b58800; } .offline { color: #888; }
.problems { color: #c62828; } .ok { color: #2e9d4e; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; margin-top: 1.5em; }
figure { margin: 0; }
"""

_SCRIPT = """
// the task's metric (Metric.cells in phalanx/tasks/metric.py): accuracy, or validation loss and perplexity
const evaluation = (r, metric) => {
  const v = metric === "accuracy" ? r.accuracy : r.eval_loss;
  if (metric === "accuracy") return [v === null ? "" : v.toFixed(4)];
  return v === null ? ["", ""] : [v.toFixed(4), Math.exp(Math.min(v, 50)).toFixed(2)];
};
const cols = (r, metric) => [
  [r.short_id, "", r.peer_id], [r.role, ""], [r.state, r.state], [r.version, ""], [String(r.step), "num"],
  [r.samples_per_s.toFixed(0), "num"], [r.loss === null ? "" : r.loss.toFixed(4), "num"],
  ...evaluation(r, metric).map((text) => [text, "num"]), [r.last_seen_s.toFixed(0) + " s", "num"],
  [r.reachability + (r.relayed_bytes ? " (" + (r.relayed_bytes / 1e6).toFixed(1) + " MB relayed)" : ""), ""], [r.problems.length ? r.problems.join("; ") : "none", r.problems.length ? "problems" : "ok"]];
let generation = -1;
async function refresh() {
  try {
    const data = await (await fetch("/api/v1/peers", {cache: "no-store"})).json();
    const body = document.querySelector("#peers tbody");
    body.replaceChildren(...data.peers.map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.peerId = r.peer_id;
      for (const [text, cls, title] of cols(r, data.metric)) {
        const td = document.createElement("td");
        td.textContent = text; if (cls) td.className = cls; if (title) td.title = title;
        tr.appendChild(td);
      }
      return tr;
    }));
    const online = data.by_state.online || 0;
    document.getElementById("summary").textContent =
      `${data.peers.length} peers, ${online} online, ${data.problems} with problems (poll ${data.polls})`;
    if (data.polls !== generation) {
      generation = data.polls;
      for (const img of document.querySelectorAll("img.plot")) {
        const next = new Image();
        next.onload = () => { img.src = next.src; };
        next.src = `/plots/${img.dataset.kind}.png?poll=${generation}`;
      }
    }
  } catch (e) { console.warn("refresh failed", e); }
}
setInterval(refresh, 3000);
"""


def _columns(metric: Metric) -> tuple[str, ...]:
    return ("peer", "role", "state", "version", "step", "samples/s", "train loss", *metric.columns, "last seen", "reach", "problems")


def _row(r: PeerRow, metric: Metric) -> str:
    cells = [
        (r.short_id, "", r.peer_id),
        (r.role, "", ""),
        (r.state, r.state, ""),
        (r.version, "", ""),
        (str(r.step), "num", ""),
        (f"{r.samples_per_s:.0f}", "num", ""),
        ("" if r.loss is None else f"{r.loss:.4f}", "num", ""),
        *((text, "num", "") for text in metric.cells(r.value(metric))),
        (f"{r.last_seen_s:.0f} s", "num", ""),
        (r.reach(), "", ""),
        ("; ".join(r.problems) if r.problems else "none", "problems" if r.problems else "ok", ""),
    ]
    tds = "".join(
        f"<td{f' class={_q(cls)}' if cls else ''}{f' title={_q(title)}' if title else ''}>{html.escape(text)}</td>"
        for text, cls, title in cells
    )
    return f"<tr data-peer-id={_q(r.peer_id)}>{tds}</tr>"


def _q(text: str) -> str:
    return '"' + html.escape(text, quote=True) + '"'


def render_page(run_id: str, rows: list[PeerRow], polls: int) -> str:
    online = sum(r.state == "online" for r in rows)
    problems = sum(bool(r.problems) for r in rows)
    metric = swarm_metric(r.metric for r in rows if r.role == "trainer")
    head = "".join(f"<th>{c}</th>" for c in _columns(metric))
    figures = "".join(
        f'<figure><img class="plot" id="plot-{kind}" data-kind="{kind}" src="/plots/{kind}.png?poll={polls}" '
        f'alt={_q(title)} width="576" height="288"></figure>'
        for kind, (title, _) in PLOTS.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Phalanx swarm {html.escape(run_id)}</title>
<style>{_STYLE}</style></head>
<body>
<h1>Phalanx swarm <code>{html.escape(run_id)}</code></h1>
<p id="summary">{len(rows)} peers, {online} online, {problems} with problems (poll {polls})</p>
<table id="peers"><thead><tr>{head}</tr></thead><tbody>{"".join(_row(r, metric) for r in rows)}</tbody></table>
<div class="plots">{figures}</div>
<p><a href="/api/v1/status">JSON status</a> · <a href="/metrics">Prometheus metrics</a></p>
<script>{_SCRIPT}</script>
</body></html>
"""
