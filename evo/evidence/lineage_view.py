"""Draw a run's lineage: a self-contained interactive HTML page (Plotly, its JS inlined: nothing is fetched
when the page opens), a static PNG of the tree and a best-so-far plot (Matplotlib), written to
`RUN_DIR/lineage/` after every generation and at the end, and queued for the MLflow parent run (the
page once, at the end). The page leads with the winner's paired claim; re-timed candidates are ringed,
and one that timed faster than the winner but is not it says why (`Lineage.not_the_winner`).

The tree: one node per evaluated candidate, one column per generation (parents left, children right),
colour and marker by status, size by latency (faster is bigger), the best engine a star and its whole
ancestry (through both parents of integration children) outlined and linked in gold; each edge's hover
names the agent, the move and the latency change. Clicking a node shows its genome, its genes changed
against each parent, its status message and the evaluator that measured it.
"""
from __future__ import annotations

import html
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from evo.evidence.lineage import Lineage, Node, gene_diff, load_lineage
from evo.evidence.claims import claim_sentence
from evo.evidence.sink import FINISHED, Sink

log = logging.getLogger("evo.evidence.lineage")

LINEAGE_DIR = "lineage"
# status -> (colour, Plotly symbol, Matplotlib marker)
STATUS_STYLE: dict[str, tuple[str, str, str]] = {
    "ok": ("#2e9d4f", "circle", "o"),
    "incorrect": ("#f28e2b", "x", "X"),
    "build_error": ("#d62728", "square", "s"),
    "runtime_error": ("#9467bd", "diamond", "D"),
    "timeout": ("#7f7f7f", "triangle-up", "^"),
    "suspect": ("#8c564b", "hexagon", "h"),
}
GOLD, EDGE_GREY = "#e0a100", "#c9cdd2"
RETIMED = "#1f4e79"  # the ring around a candidate a paired re-timing examined


@dataclass(frozen=True)
class LineageFiles:
    html: Path
    png: Path
    best_so_far_png: Path

    def all(self) -> list[Path]:
        return [self.html, self.png, self.best_so_far_png]


def write_lineage(run_dir: Path, out_dir: Path | None = None, lineage: Lineage | None = None) -> LineageFiles:
    """Write lineage.html, lineage.png and best_so_far.png (atomically) to `out_dir` (default RUN_DIR/lineage)."""
    lineage = lineage or load_lineage(run_dir)
    out_dir = Path(out_dir) if out_dir else Path(run_dir) / LINEAGE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    files = LineageFiles(out_dir / "lineage.html", out_dir / "lineage.png", out_dir / "best_so_far.png")
    _atomic(files.html, lambda tmp: tmp.write_text(render_html(lineage), encoding="utf-8"))
    _atomic(files.png, lambda tmp: render_tree_png(lineage, tmp))
    _atomic(files.best_so_far_png, lambda tmp: render_best_so_far_png(lineage, tmp))
    return files


class LineageSink(Sink):
    """Search sink: rewrites the lineage files after a generation when `min_interval_s` have passed since
    the last drawing (the plots take ~1 s of the driver's CPU each time) and always when the run ends
    (`close`), and queues them for the MLflow parent run (so it closes before MLflow's sink): the two
    pictures after each drawing, the page (~5 MB: Plotly inlined) once, at the end, so a run stores it
    once. Drawing never stops a search: a failure is logged, and `python -m evo report RUN_DIR` draws the
    files again from the evidence on disk."""

    def __init__(self, run_dir: Path, mlflow_sink=None, min_interval_s: float = 30.0) -> None:
        self.run_dir, self.mlflow_sink = Path(run_dir), mlflow_sink
        self.min_interval_s = min_interval_s
        self._drawn_at = time.monotonic()  # a search's first drawing comes min_interval_s in

    def on_generation(self, report, search) -> None:
        if time.monotonic() - self._drawn_at >= self.min_interval_s:
            self.write()

    def close(self, summary=None, status: str = FINISHED) -> None:
        self.write(final=True)

    def write(self, final: bool = False) -> LineageFiles | None:
        """Draw the files; queue the pictures for MLflow, and the page too when `final`."""
        self._drawn_at = time.monotonic()
        try:
            files = write_lineage(self.run_dir)
        except Exception as exc:  # noqa: BLE001 - the evidence is on disk; the drawing can be redone
            log.warning("could not draw the lineage of %s (%s: %s); draw it later with `python -m evo report %s`",
                        self.run_dir, type(exc).__name__, exc, self.run_dir)
            return None
        if self.mlflow_sink is not None:
            self.mlflow_sink.log_lineage(files.all() if final else [files.png, files.best_so_far_png])
        return files


# --- layout ---------------------------------------------------------------------------------------

def layout(lineage: Lineage) -> dict[str, tuple[float, float]]:
    """(x, y) per node: x is the generation; within a generation, children sit near their parents."""
    by_generation: dict[int, list[Node]] = {}
    for node in lineage.nodes.values():
        by_generation.setdefault(node.generation, []).append(node)
    pos: dict[str, tuple[float, float]] = {}
    for generation in sorted(by_generation):
        def key(node: Node) -> tuple[float, int]:
            ys = [pos[p][1] for p in node.parents if p in pos]
            return (sum(ys) / len(ys) if ys else 0.0, node.index)

        ordered = sorted(by_generation[generation], key=key)
        for i, node in enumerate(ordered):
            pos[node.hash] = (float(generation), (len(ordered) - 1) / 2 - i)
    return pos


def _size(node: Node, fastest: float) -> float:
    return 10 + 14 * (fastest / node.latency_ms) if node.ok and fastest > 0 else 9


def _fastest(lineage: Lineage) -> float:
    ok = [n.latency_ms for n in lineage.nodes.values() if n.ok]
    return min(ok) if ok else math.nan


def _delta(child: Node, parent: Node) -> str:
    if child.ok and parent.ok:
        change = child.latency_ms - parent.latency_ms
        return f"{change:+.3f} ms ({parent.latency_ms / child.latency_ms:.2f}x)"
    return f"{child.status} (parent {parent.status})" if not child.ok else "parent not measured"


# --- HTML -----------------------------------------------------------------------------------------

def render_html(lineage: Lineage) -> str:
    """The whole page as one string: Plotly's JS, the data and the page's own JS inlined."""
    from plotly.offline import get_plotlyjs

    tree = _tree_figure(lineage).to_html(
        full_html=False, include_plotlyjs=False, div_id="lineage-tree", config={"displaylogo": False},
        post_script="document.getElementById('{plot_id}').on('plotly_click', lineageClick);")
    progress = _best_so_far_figure(lineage).to_html(
        full_html=False, include_plotlyjs=False, div_id="best-so-far", config={"displaylogo": False},
        post_script="document.getElementById('{plot_id}').on('plotly_click', lineageClick);")
    data = json.dumps(_page_data(lineage), allow_nan=False).replace("</", "<\\/")
    return _PAGE.format(
        title=html.escape(f"Lineage of {lineage.name}"), style=_STYLE, plotlyjs=get_plotlyjs(),
        headline=_headline(lineage), ancestry=_ancestry_table(lineage), tree=tree, progress=progress,
        data=data, app=_APP, generated=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))


def _headline(lineage: Lineage) -> str:
    counts: dict[str, int] = {}
    for node in lineage.nodes.values():
        counts[node.status] = counts.get(node.status, 0) + 1
    tally = " · ".join(f'<span class="badge s-{s}">{s} {n}</span>' for s, n in sorted(counts.items()))
    if lineage.best is None:
        return f"<p>No correct engine yet among {len(lineage.nodes)} candidates. {tally}</p>"
    best = lineage.nodes[lineage.best]
    code = f'<code id="best-hash">{best.hash}</code>'
    if lineage.summary is not None and lineage.summary.found:  # the winner by its confirmed claim, first
        claim = html.escape(claim_sentence(lineage.summary)).replace(f"`{best.hash}`", code)
    else:
        claim = f"Best engine so far {code} (a single timing: the run has no summary yet, nothing is claimed)"
    vs = (f", {lineage.baseline[1] / best.latency_ms:.2f}x the best baseline "
          f"{html.escape(lineage.baseline[0])} ({lineage.baseline[1]:.3f} ms)") if lineage.baseline else ""
    return (f'<p id="best-line"><b id="claim">{claim}.</b><br>Single timing (one evaluation\'s median, not a claim): '
            f"{best.latency_ms:.3f} ms{vs}; found in generation {best.generation} by {html.escape(best.agent)}, "
            f"{len(lineage.chain()) - 1} step(s) from its seed.</p><p>{len(lineage.nodes)} candidates: {tally}"
            f" · {len(lineage.retimed())} re-timed paired</p>" + _not_the_winner_table(lineage))


def _not_the_winner_table(lineage: Lineage) -> str:
    """The candidates whose single timing beats the winner's, and why each is not the winner."""
    why = lineage.not_the_winner()
    if not why:
        return ""
    rows = "".join(f'<tr data-hash="{h}"><td>{lineage.nodes[h].generation}</td><td><code>{h}</code></td>'
                   f"<td>{lineage.nodes[h].latency_ms:.3f}</td><td>{html.escape(reason)}</td></tr>"
                   for h, reason in why.items())
    return ('<h2>Looked faster, not the winner</h2><p class="hint">A single timing ranks the candidates (and sizes the '
            "nodes below); only a paired re-timing makes a winner. These timed faster once than the winner:</p>"
            '<table id="not-the-winner"><thead><tr><th>gen</th><th>hash</th><th>single timing ms</th><th>why not the '
            f"winner</th></tr></thead><tbody>{rows}</tbody></table>")


def _ancestry_table(lineage: Lineage) -> str:
    if lineage.best is None:
        return "<p>No best engine yet.</p>"
    rows = []
    for step in lineage.chain():
        n = step.node
        gain = "seed" if step.parent is None else f"{step.speedup:.2f}x ({-step.gain_ms:+.3f} ms)"
        parents = ", ".join(f"<code>{p}</code>" for p in n.parents) or "-"
        rows.append(f'<tr data-hash="{n.hash}"><td>{n.generation}</td><td><code>{n.hash}</code></td>'
                    f"<td>{html.escape(n.agent)}</td><td>{html.escape(n.move)}</td><td>{n.latency_ms:.3f}</td>"
                    f"<td>{gain}</td><td>{parents}</td></tr>")
    return ('<table id="ancestry"><thead><tr><th>gen</th><th>hash</th><th>agent</th><th>move</th>'
            "<th>latency ms</th><th>gain over first parent</th><th>parents</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _page_data(lineage: Lineage) -> dict[str, Any]:
    nodes, retimed, why_not = {}, lineage.retimed(), lineage.not_the_winner()
    for node in lineage.nodes.values():
        diffs = []
        for parent in node.parents:
            other = lineage.nodes.get(parent)
            diffs.append({"parent": parent, "known": other is not None,
                          "delta": _delta(node, other) if other else "",
                          "genes": [[g, _js(a), _js(b)] for g, a, b in gene_diff(node, other)] if other else []})
        nodes[node.hash] = {"generation": node.generation, "index": node.index, "agent": node.agent, "move": node.move,
                            "status": node.status, "message": node.message, "error": node.error[-4000:],
                            "latency_ms": node.latency_ms if node.ok else None, "evaluator": node.evaluator,
                            "genes": [[g, _js(v)] for g, v in node.genes().items()], "diffs": diffs,
                            "retimings": [t.describe() for t in retimed.get(node.hash, [])],
                            "why_not_winner": why_not.get(node.hash)}
    return {"best": lineage.best, "ancestry": sorted(lineage.ancestors(lineage.best)), "nodes": nodes}


def _js(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


def _tree_figure(lineage: Lineage):
    import plotly.graph_objects as go

    pos, fastest, ancestry = layout(lineage), _fastest(lineage), lineage.ancestors(lineage.best)
    chain = {(s.parent.hash, s.node.hash) for s in lineage.chain() if s.parent}
    fig = go.Figure()
    groups = {"parent → child": ([], [], EDGE_GREY, 1.2, "solid"), "second parent": ([], [], EDGE_GREY, 1.2, "dot"),
              "best ancestry": ([], [], GOLD, 3.5, "solid")}
    mid_x, mid_y, mid_text, mid_hash, label_x, label_y, labels = [], [], [], [], [], [], []
    for parent, child in lineage.edges():
        c, p = lineage.nodes[child], lineage.nodes[parent]
        kind = "best ancestry" if child in ancestry and parent in ancestry else (
            "second parent" if c.parents.index(parent) > 0 else "parent → child")
        xs, ys = groups[kind][0], groups[kind][1]
        (x0, y0), (x1, y1) = pos[parent], pos[child]
        xs += [x0, x1, None]
        ys += [y0, y1, None]
        mx, my = (x0 + x1) / 2, (y0 + y1) / 2
        mid_x.append(mx)
        mid_y.append(my)
        mid_hash.append(child)
        mid_text.append(f"{parent[:8]} → {child[:8]}<br>agent: {html.escape(c.agent)}<br>"
                        f"move: {html.escape(c.move)}<br>latency: {_delta(c, p)}")
        if (parent, child) in chain:  # the steps `python -m evo report` prints
            label_x.append(mx)
            label_y.append(my)
            labels.append(f"{html.escape(c.agent)} {c.latency_ms - p.latency_ms:+.2f} ms" if c.ok and p.ok else c.agent)
    for name, (xs, ys, colour, width, dash) in groups.items():
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=name, hoverinfo="skip",
                                     line={"color": colour, "width": width, "dash": dash}))
    fig.add_trace(go.Scatter(x=mid_x, y=mid_y, mode="markers", name="edges", showlegend=False, customdata=mid_hash,
                             hovertext=mid_text, hoverinfo="text", marker={"size": 10, "color": "rgba(0,0,0,0)"}))
    fig.add_trace(go.Scatter(x=label_x, y=label_y, mode="text", text=labels, showlegend=False, hoverinfo="skip",
                             textfont={"size": 10, "color": "#8a6400"}, textposition="top center"))
    for status, (colour, symbol, _) in STATUS_STYLE.items():
        nodes = [n for n in lineage.nodes.values() if n.status == status]
        if not nodes:
            continue
        fig.add_trace(go.Scatter(
            x=[pos[n.hash][0] for n in nodes], y=[pos[n.hash][1] for n in nodes], mode="markers+text", name=status,
            customdata=[n.hash for n in nodes], hovertext=[_hover(n) for n in nodes], hoverinfo="text",
            text=[_label(n, n.hash in ancestry) for n in nodes], textposition="middle right",
            textfont={"size": 10}, cliponaxis=False,
            marker={"color": colour, "symbol": symbol, "size": [_size(n, fastest) for n in nodes],
                    "line": {"color": [GOLD if n.hash in ancestry else "white" for n in nodes],
                             "width": [3 if n.hash in ancestry else 1 for n in nodes]}}))
    retimed, why_not = lineage.retimed(), lineage.not_the_winner()
    if retimed:  # a ring around each candidate a paired re-timing examined
        ring = [lineage.nodes[h] for h in retimed]
        fig.add_trace(go.Scatter(
            x=[pos[n.hash][0] for n in ring], y=[pos[n.hash][1] for n in ring], mode="markers",
            name="re-timed (paired)", customdata=[n.hash for n in ring], hoverinfo="text",
            hovertext=[f"<b>{n.hash}</b> re-timed paired:<br>" + "<br>".join(html.escape(t.describe()[:160])
                                                                           for t in retimed[n.hash]) for n in ring],
            marker={"symbol": "circle-open", "color": RETIMED, "size": [_size(n, fastest) + 9 for n in ring],
                    "line": {"width": 2}}))
    if why_not:  # looked faster than the winner by a single timing: say why it is not the winner
        looked = [lineage.nodes[h] for h in why_not]
        fig.add_trace(go.Scatter(
            x=[pos[n.hash][0] for n in looked], y=[pos[n.hash][1] for n in looked], mode="markers",
            name="looked faster, not the winner", customdata=[n.hash for n in looked], hoverinfo="text",
            hovertext=[f"<b>{n.hash}</b> {n.latency_ms:.3f} ms (single timing)<br>not the winner: "
                       f"{html.escape(why_not[n.hash])}" for n in looked],
            marker={"symbol": "x-thin-open", "color": "#b00020", "size": 9, "line": {"width": 1.5}}))
    if lineage.best:
        best = lineage.nodes[lineage.best]
        fig.add_trace(go.Scatter(x=[pos[best.hash][0]], y=[pos[best.hash][1]], mode="markers", name="best engine",
                                 customdata=[best.hash], hovertext=[_hover(best)], hoverinfo="text",
                                 marker={"symbol": "star", "size": 26, "color": GOLD, "line": {"color": "#5a4000", "width": 1.5}}))
    generations = sorted({n.generation for n in lineage.nodes.values()})
    widest = max([sum(1 for n in lineage.nodes.values() if n.generation == g) for g in generations] or [1])
    fig.update_layout(
        height=max(400, 170 + 46 * widest), margin={"l": 20, "r": 20, "t": 36, "b": 70}, plot_bgcolor="white",
        hovermode="closest", clickmode="event", legend={"orientation": "h", "y": -0.16, "yanchor": "top", "x": 0},
        xaxis={"title": {"text": "generation (parents left, children right)", "standoff": 4}, "tickmode": "array", "tickvals": generations,
               "range": [min(generations or [0]) - 0.3, max(generations or [0]) + 0.75], "showgrid": False, "zeroline": False},
        yaxis={"visible": False})
    return fig


def _label(node: Node, in_ancestry: bool) -> str:
    latency = f"{node.latency_ms:.2f} ms" if node.ok else ""
    return f"<b>{node.hash[:8]}</b> {latency}" if in_ancestry else latency


def _hover(node: Node) -> str:
    latency = f"{node.latency_ms:.3f} ms" if node.ok else "no latency"
    message = html.escape(node.message[:160])
    return (f"<b>{node.hash}</b><br>generation {node.generation} · {html.escape(node.agent)}<br>"
            f"{html.escape(node.move)}<br>{node.status} · {latency} · {html.escape(node.evaluator)}<br>{message}")


def _progress_points(lineage: Lineage) -> tuple[list[tuple[Node, float]], float | None, float]:
    """(node, best so far) in arrival order, the start time (None without timestamps), and the y of failures."""
    points = lineage.best_so_far()
    ok = [n.latency_ms for n, _ in points if n.ok]
    fail_y = max(ok) * 1.15 if ok else 1.0
    if lineage.baseline:
        fail_y = max(fail_y, lineage.baseline[1] * 1.1)
    started = lineage.started_at() if all(n.recorded_at is not None for n, _ in points) else None
    return points, started, fail_y


def _best_so_far_figure(lineage: Lineage):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    points, started, fail_y = _progress_points(lineage)
    titles = ("best so far over evaluations",
              "best so far over wall time" if started is not None else "wall time: this run's journal has no timestamps")
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, subplot_titles=titles, horizontal_spacing=0.06)
    axes = [(1, [i + 1 for i in range(len(points))], "evaluation")]
    if started is not None:
        axes.append((2, [n.recorded_at - started for n, _ in points], "wall time (s)"))
    for col, xs, title in axes:
        best = [(x, b) for x, (_, b) in zip(xs, points) if math.isfinite(b)]
        fig.add_trace(go.Scatter(x=[x for x, _ in best], y=[b for _, b in best], mode="lines", line_shape="hv",
                                 name="best so far", legendgroup="best", showlegend=col == 1,
                                 line={"color": "#1f4e79", "width": 2.5}, hoverinfo="skip"), row=1, col=col)
        for status, (colour, symbol, _) in STATUS_STYLE.items():
            chosen = [(x, n) for x, (n, _) in zip(xs, points) if n.status == status]
            if chosen:
                fig.add_trace(go.Scatter(
                    x=[x for x, _ in chosen], y=[n.latency_ms if n.ok else fail_y for _, n in chosen],
                    mode="markers", name=status, legendgroup=status, showlegend=col == 1,
                    customdata=[n.hash for _, n in chosen], hovertext=[_hover(n) for _, n in chosen], hoverinfo="text",
                    marker={"color": colour, "symbol": symbol, "size": 9, "line": {"color": "white", "width": 0.5}}),
                    row=1, col=col)
        fig.update_xaxes(title_text=title, row=1, col=col)
    if lineage.baseline:
        fig.add_hline(y=lineage.baseline[1], line_dash="dash", line_color="#888",
                      annotation_text=f"best baseline {html.escape(lineage.baseline[0])}", annotation_position="top left")
    fig.update_yaxes(title_text="latency ms (failures on top)", row=1, col=1)
    fig.update_layout(height=380, margin={"l": 50, "r": 20, "t": 40, "b": 40}, plot_bgcolor="white",
                      legend={"orientation": "h", "y": -0.25}, hovermode="closest")
    return fig


# --- PNG ------------------------------------------------------------------------------------------

def render_tree_png(lineage: Lineage, path: Path) -> None:
    """The tree as a static picture: same layout, colours and highlights as the page."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    pos, fastest, ancestry = layout(lineage), _fastest(lineage), lineage.ancestors(lineage.best)
    chain = {(s.parent.hash, s.node.hash) for s in lineage.chain() if s.parent}
    generations = sorted({n.generation for n in lineage.nodes.values()}) or [0]
    widest = max([sum(1 for n in lineage.nodes.values() if n.generation == g) for g in generations] or [1])
    fig = Figure(figsize=(3 + 2.6 * len(generations), 2.2 + 0.55 * widest), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for parent, child in lineage.edges():
        (x0, y0), (x1, y1) = pos[parent], pos[child]
        gold = child in ancestry and parent in ancestry
        second = lineage.nodes[child].parents.index(parent) > 0
        ax.plot([x0, x1], [y0, y1], color=GOLD if gold else EDGE_GREY, lw=3 if gold else 1,
                ls=":" if second and not gold else "-", zorder=2 if gold else 1)
        if (parent, child) in chain:
            c, p = lineage.nodes[child], lineage.nodes[parent]
            text = f"{c.agent} {c.latency_ms - p.latency_ms:+.2f} ms" if c.ok and p.ok else c.agent
            ax.annotate(text, ((x0 + x1) / 2, (y0 + y1) / 2), fontsize=7, color="#8a6400", ha="center", va="bottom")
    for status, (colour, _, marker) in STATUS_STYLE.items():
        nodes = [n for n in lineage.nodes.values() if n.status == status]
        if nodes:
            ax.scatter([pos[n.hash][0] for n in nodes], [pos[n.hash][1] for n in nodes], marker=marker, c=colour,
                       s=[_size(n, fastest) ** 2 * 0.9 for n in nodes], zorder=3,
                       edgecolors=[GOLD if n.hash in ancestry else "white" for n in nodes],
                       linewidths=[2.5 if n.hash in ancestry else 0.8 for n in nodes], label=status)
    retimed, why_not = lineage.retimed(), lineage.not_the_winner()
    if retimed:
        ax.scatter([pos[h][0] for h in retimed], [pos[h][1] for h in retimed], marker="o", facecolors="none",
                   edgecolors=RETIMED, linewidths=1.8, zorder=3.5, label="re-timed (paired)",
                   s=[(_size(lineage.nodes[h], fastest) + 9) ** 2 * 0.9 for h in retimed])
    if why_not:
        ax.scatter([pos[h][0] for h in why_not], [pos[h][1] for h in why_not], marker="x", c="#b00020", s=40,
                   linewidths=1.5, zorder=3.6, label="looked faster, not the winner")
    for node in lineage.nodes.values():
        x, y = pos[node.hash]
        offset = (_size(node, fastest) / 2 + 4, 0)
        if node.hash in ancestry:
            ax.annotate(f"{node.hash[:8]} {node.latency_ms:.2f} ms" if node.ok else node.hash[:8], (x, y),
                        xytext=offset, textcoords="offset points", fontsize=7.5, fontweight="bold", va="center")
        elif node.ok:
            ax.annotate(f"{node.latency_ms:.2f}", (x, y), xytext=offset, textcoords="offset points", fontsize=6.5,
                        color="#555", va="center")
    if lineage.best:
        x, y = pos[lineage.best]
        ax.scatter([x], [y], marker="*", s=420, c=GOLD, edgecolors="#5a4000", linewidths=1, zorder=4)
    handles = [Line2D([], [], color=GOLD, lw=3, label="best ancestry"),
               Line2D([], [], color=EDGE_GREY, ls=":", label="second parent"),
               Line2D([], [], marker="*", ls="", color=GOLD, markersize=13, label="best engine")]
    ax.legend(handles=ax.get_legend_handles_labels()[0] + handles, loc="upper left", bbox_to_anchor=(0, -0.08),
              ncol=5, fontsize=8, frameon=False)
    ax.set_xticks(generations)
    ax.set_xlim(generations[0] - 0.3, generations[-1] + 0.8)
    ax.set_xlabel("generation")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_title(_png_title(lineage), fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(path, format="png")


def render_best_so_far_png(lineage: Lineage, path: Path) -> None:
    """Best latency so far over evaluations and over wall time, one marker per status."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points, started, fail_y = _progress_points(lineage)
    fig = Figure(figsize=(11, 4), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    series = [(axes[0], [i + 1 for i in range(len(points))], "evaluation")]
    if started is not None:
        series.append((axes[1], [n.recorded_at - started for n, _ in points], "wall time (s)"))
    else:
        axes[1].text(0.5, 0.5, "this run's journal has no timestamps", ha="center", transform=axes[1].transAxes)
    for ax, xs, title in series:
        best = [(x, b) for x, (_, b) in zip(xs, points) if math.isfinite(b)]
        ax.step([x for x, _ in best], [b for _, b in best], where="post", color="#1f4e79", lw=2, label="best so far")
        for status, (colour, _, marker) in STATUS_STYLE.items():
            chosen = [(x, n) for x, (n, _) in zip(xs, points) if n.status == status]
            if chosen:
                ax.scatter([x for x, _ in chosen], [n.latency_ms if n.ok else fail_y for _, n in chosen],
                           marker=marker, c=colour, s=30, label=status, zorder=3)
        if lineage.baseline:
            ax.axhline(lineage.baseline[1], ls="--", color="#888", lw=1, label=f"baseline {lineage.baseline[0]}")
        ax.set_xlabel(title)
    axes[0].set_ylabel("latency ms (failures on top)")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(_png_title(lineage), fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, format="png")


def _png_title(lineage: Lineage) -> str:
    if lineage.best is None:
        return f"{lineage.name}: no correct engine among {len(lineage.nodes)} candidates"
    best = lineage.nodes[lineage.best]
    if lineage.summary is not None and lineage.summary.found:  # the claim, as the page states it
        return f"{lineage.name}: {claim_sentence(lineage.summary, code='')}; {len(lineage.nodes)} candidates"
    vs = f", {lineage.baseline[1] / best.latency_ms:.2f}x vs {lineage.baseline[0]}" if lineage.baseline else ""
    return (f"{lineage.name}: best so far {best.hash} {best.latency_ms:.3f} ms{vs} (single timings, nothing claimed"
            f" yet), {len(lineage.nodes)} candidates")


def _atomic(path: Path, write) -> None:
    """Write through a temporary file and rename, so MLflow or a browser never reads half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


# --- page template --------------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px; color: #1d232a; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 18px 0 6px; } h3 { font-size: 14px; margin: 12px 0 4px; }
code { font: 12.5px ui-monospace, Menlo, Consolas, monospace; background: #f2f4f7; padding: 0 3px; border-radius: 3px; }
#layout { display: grid; grid-template-columns: minmax(0, 2.4fr) minmax(320px, 1fr); gap: 14px; align-items: start; }
@media (max-width: 1100px) { #layout { grid-template-columns: minmax(0, 1fr); } }
#tree-box { min-width: 0; border: 1px solid #e3e6ea; border-radius: 6px; }
#details { border: 1px solid #e3e6ea; border-radius: 6px; padding: 8px 12px; max-height: 85vh; overflow: auto; }
table { border-collapse: collapse; font-size: 13px; } td { overflow-wrap: anywhere; } td, th { border-bottom: 1px solid #e8eaed; padding: 3px 8px; text-align: left; vertical-align: top; }
#ancestry tbody tr, #not-the-winner tbody tr { cursor: pointer; } #ancestry tbody tr:hover, #not-the-winner tbody tr:hover { background: #fff6d6; }
.why-not { color: #b00020; }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; color: white; font-size: 12px; }
.s-ok { background: #2e9d4f; } .s-incorrect { background: #f28e2b; } .s-build_error { background: #d62728; }
.s-runtime_error { background: #9467bd; } .s-timeout { background: #7f7f7f; } .s-suspect { background: #8c564b; }
.hint, footer { color: #66707a; font-size: 12px; } pre { white-space: pre-wrap; font-size: 12px; background: #f6f7f9; padding: 6px; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 10px; margin: 6px 0; } dt { color: #66707a; } dd { margin: 0; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{style}</style>
<script>window.PlotlyConfig = {{MathJaxConfig: 'local'}};</script>
<script>{plotlyjs}</script>
<script>const LINEAGE = {data};</script>
<script>{app}</script>
</head><body>
<h1>{title}</h1>
{headline}
<div id="layout">
<div id="tree-box">{tree}<p class="hint">&nbsp;One node per evaluated candidate; colour and marker: status; size: latency
by one single timing (faster is bigger). Blue ring: re-timed paired; red cross: timed faster once than the winner
but not the winner (why: hover it, or the table above). A paired re-timing, not size, decides the winner.
Gold: the best engine (star) and its ancestry. Hover an edge for agent, move and latency change;
click a node for its genome and its genes changed against each parent.</p></div>
<div id="details"><p class="hint">Click a node to see its genome, the genes it changed against each parent, its
status message and the evaluator that measured it.</p></div>
</div>
<h2>Ancestry of the best engine</h2>
{ancestry}
<h2>Best so far</h2>
{progress}
<footer>Written by engine-factory at {generated}.</footer>
</body></html>
"""

_APP = r"""
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function show(hash) {
  const n = LINEAGE.nodes[hash];
  const box = document.getElementById('details');
  if (!n || !box) return;
  const best = hash === LINEAGE.best ? ' (best engine)' : (LINEAGE.ancestry.includes(hash) ? ' (ancestor of the best)' : '');
  const latency = n.latency_ms === null ? 'no latency' : n.latency_ms.toFixed(3) + ' ms';
  const parts = [el('h2', {}, 'Candidate ', el('code', {id: 'selected-hash'}, hash), best),
    el('p', {}, el('span', {class: 'badge s-' + n.status}, n.status), ' ', latency),
    el('dl', {}, el('dt', {}, 'generation'), el('dd', {}, n.generation + ' (#' + n.index + ')'),
      el('dt', {}, 'agent'), el('dd', {}, n.agent), el('dt', {}, 'move'), el('dd', {}, n.move),
      el('dt', {}, 'evaluator'), el('dd', {}, n.evaluator || '-'), el('dt', {}, 'message'), el('dd', {}, n.message || '-'))];
  if (n.why_not_winner) parts.push(el('p', {class: 'why-not'}, 'Looked faster than the winner (single timing), not the winner: ' + n.why_not_winner));
  if (n.retimings.length) parts.push(el('h3', {}, 'Paired re-timings'), ...n.retimings.map(t => el('p', {class: 'hint'}, t)));
  if (n.error) parts.push(el('h3', {}, 'Error'), el('pre', {}, n.error));
  if (!n.diffs.length) parts.push(el('h3', {}, 'No parents: a seed'));
  for (const d of n.diffs) {
    parts.push(el('h3', {}, 'Genes changed vs parent ', el('code', {}, d.parent.slice(0, 12))));
    if (!d.known) { parts.push(el('p', {class: 'hint'}, 'parent not evaluated in this run')); continue; }
    parts.push(el('p', {class: 'hint'}, 'latency ' + d.delta));
    const rows = d.genes.map(([g, a, b]) => el('tr', {}, el('td', {}, g), el('td', {}, JSON.stringify(a)), el('td', {}, JSON.stringify(b))));
    parts.push(rows.length ? el('table', {class: 'diff'}, el('tr', {}, el('th', {}, 'gene'), el('th', {}, 'parent'), el('th', {}, 'this')), ...rows)
                           : el('p', {class: 'hint'}, 'no gene differs'));
  }
  parts.push(el('h3', {}, 'Genome'), el('table', {class: 'genome'}, ...n.genes.map(([g, v]) => el('tr', {}, el('td', {}, g), el('td', {}, JSON.stringify(v))))));
  box.replaceChildren(...parts);
}
function lineageClick(event) {
  const hash = event && event.points && event.points[0] && event.points[0].customdata;
  if (hash) show(hash);
}
document.addEventListener('DOMContentLoaded', () => {
  for (const row of document.querySelectorAll('#ancestry tbody tr, #not-the-winner tbody tr')) row.addEventListener('click', () => show(row.dataset.hash));
  if (LINEAGE.best) show(LINEAGE.best);
  // Plotly sized the plots while the page was still being parsed: fit them to the finished layout.
  for (const id of ['lineage-tree', 'best-so-far']) if (window.Plotly && document.getElementById(id)) Plotly.Plots.resize(id);
});
"""
