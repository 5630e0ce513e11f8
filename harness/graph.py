"""The slice dependency DAG: text tree, Mermaid, Graphviz dot, and a PNG/SVG drawn with networkx + matplotlib."""
from __future__ import annotations

import textwrap
from pathlib import Path

import networkx as nx

from .goldens import atomic_savefig
from .registry import Registry

STATUS_COLOURS = {"planned": "#d9d9d9", "implemented": "#9ecae1", "verified": "#74c476"}


def subgraph_ids(reg: Registry, focus: str | None) -> list[str]:
    if focus is None:
        return reg.order()
    sid = reg.get(focus).id
    keep = reg.ancestors(sid) | reg.descendants(sid) | {sid}
    return [s for s in reg.order() if s in keep]


def to_nx(reg: Registry, ids: list[str]) -> nx.DiGraph:
    g = nx.DiGraph()
    for sid in ids:
        g.add_node(sid)
    for sid in ids:
        for d in reg.slices[sid].depends_on:
            if d in ids:
                g.add_edge(d, sid)        # base -> dependent
    return g


def text_tree(reg: Registry, ids: list[str], platform: str = "cpu") -> str:
    """Each slice with its status, then its direct bases; roots first (dependency order)."""
    keep = set(ids)
    lines = []
    for sid in ids:
        s = reg.slices[sid]
        deps = [d for d in s.depends_on if d in keep]
        mark = {"planned": " ", "implemented": "*", "verified": "+"}[s.status[platform]]
        lines.append(f"[{mark}] {sid:6} {s.title}")
        for i, d in enumerate(deps):
            lines.append(f"     {'└──' if i == len(deps) - 1 else '├──'} needs {d}")
    lines.append(f"legend: [+] verified  [*] implemented  [ ] planned  (platform {platform})")
    return "\n".join(lines)


def _dot_str(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _mermaid_str(text: str) -> str:
    return text.replace('"', "#quot;")


def mermaid(reg: Registry, ids: list[str], platform: str = "cpu", labels: bool = False) -> str:
    def nid(s):
        return "X" + s[1:] if s.startswith("#") else s
    out = ["graph TD"]
    for sid in ids:
        s = reg.slices[sid]
        shape = {"external": ("[[", "]]"), "extension": ("{{", "}}")}.get(s.kind, ("[", "]"))
        text = _mermaid_str(f"{sid}: {s.title[:40]}" if labels else sid)
        out.append(f'  {nid(sid)}{shape[0]}"{text}"{shape[1]}:::{s.status[platform]}')
    g = to_nx(reg, ids)
    for a, b in g.edges:
        out.append(f"  {nid(a)} --> {nid(b)}")
    for st, col in STATUS_COLOURS.items():
        out.append(f"  classDef {st} fill:{col}")
    return "\n".join(out)


def dot(reg: Registry, ids: list[str], platform: str = "cpu", labels: bool = False) -> str:
    out = ["digraph slices {", "  rankdir=LR;", '  node [style=filled, fontname="Helvetica"];']
    for sid in ids:
        s = reg.slices[sid]
        shape = {"external": "box, peripheries=2, style=\"filled,dashed\"",
                 "extension": "hexagon, style=\"filled,dotted\""}.get(s.kind, "box")
        label = _dot_str(sid) + ("\\n" + _dot_str(s.title[:32]) if labels else "")
        out.append(f'  "{_dot_str(sid)}" [label="{label}", shape={shape}, '
                   f'fillcolor="{STATUS_COLOURS[s.status[platform]]}"];')
    for a, b in to_nx(reg, ids).edges:
        out.append(f'  "{_dot_str(a)}" -> "{_dot_str(b)}";')
    out.append("}")
    return "\n".join(out)


def layered_positions(reg: Registry, ids: list[str]) -> dict[str, tuple[float, float]]:
    """x = publication round, y spread evenly within a round."""
    keep = set(ids)
    pos: dict[str, tuple[float, float]] = {}
    for k, rnd in enumerate(reg.rounds()):
        col = [s for s in rnd if s in keep]
        if k:   # barycentre ordering: a slice sits near the bases it needs, which keeps crossings down
            col.sort(key=lambda s: -sum(pos[d][1] for d in reg.slices[s].depends_on if d in pos)
                     / max(1, sum(d in pos for d in reg.slices[s].depends_on)))
        for i, sid in enumerate(col):
            pos[sid] = (k * 3.0, (len(col) - 1) / 2.0 - i)
    return pos


def draw(reg: Registry, ids: list[str], path: Path, platform: str = "cpu", labels: bool = False) -> Path:
    """PNG/SVG of the DAG, written atomically (a full disk leaves an existing file as it was)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    g = to_nx(reg, ids)
    pos = layered_positions(reg, ids)
    n_rounds = len({x for x, _ in pos.values()})
    tallest = max(sum(1 for p in pos.values() if p[0] == x) for x in {p[0] for p in pos.values()})
    fig, ax = plt.subplots(figsize=(max(8, 2.3 * n_rounds), max(6, 1.25 * tallest + 2)), dpi=110)
    for kind, shape in (("external", "s"), ("prerequisite", "o"), ("dsv4", "D"), ("extension", "h")):
        nodes = [n for n in g.nodes if reg.slices[n].kind == kind]
        if not nodes:
            continue
        nx.draw_networkx_nodes(
            g, pos, nodelist=nodes, node_shape=shape, node_size=1500, ax=ax,
            node_color=[STATUS_COLOURS[reg.slices[n].status[platform]] for n in nodes],
            edgecolors="#b2182b" if kind == "external" else "#333333",
            linewidths=2.5 if kind == "external" else 1.2)
    # edges that another path already implies (e.g. most of D9's 17 direct bases) are drawn faint and dotted
    direct = set(nx.transitive_reduction(g).edges)
    implied = [e for e in g.edges if e not in direct]
    short = [e for e in sorted(direct) if pos[e[1]][0] - pos[e[0]][0] <= 3.0]
    long_ = [e for e in sorted(direct) if e not in short]      # skipping rounds: bend them around nodes
    for el, rad in ((short, 0.06), (long_, 0.22)):
        nx.draw_networkx_edges(g, pos, edgelist=el, ax=ax, arrows=True, arrowsize=16, width=1.6,
                               edge_color="#444444", node_size=1500, connectionstyle=f"arc3,rad={rad}")
    nx.draw_networkx_edges(g, pos, edgelist=implied, ax=ax, arrows=True, arrowsize=8, width=0.7, style=":",
                           edge_color="#bbbbbb", node_size=1500, connectionstyle="arc3,rad=0.06")
    nx.draw_networkx_labels(g, pos, ax=ax, font_size=10, font_weight="bold")
    if labels:       # the title, wrapped, under each node
        for n, (x, y) in pos.items():
            ax.text(x, y - 0.42, textwrap.fill(reg.slices[n].title, 22), ha="center", va="top", fontsize=6.5,
                    color="#333333")
    for x in sorted({p[0] for p in pos.values()}):
        ax.text(x, max(p[1] for p in pos.values()) + 0.9, f"round {int(x // 3)}", ha="center", fontsize=10,
                color="#555555")
    handles = [Patch(facecolor=c, edgecolor="#333", label=f"{s} ({platform})") for s, c in STATUS_COLOURS.items()]
    handles += [plt.Line2D([], [], marker="s", ls="", mfc="white", mec="#b2182b", mew=2.5, ms=12,
                           label="external prerequisite"),
                plt.Line2D([], [], marker="o", ls="", mfc="white", mec="#333", ms=12, label="fresh prerequisite (P)"),
                plt.Line2D([], [], marker="D", ls="", mfc="white", mec="#333", ms=11, label="DSv4 slice (D)"),
                plt.Line2D([], [], marker="h", ls="", mfc="white", mec="#333", ms=12, label="extension (X)"),
                plt.Line2D([], [], color="#444", lw=1.6, label="direct dependency"),
                plt.Line2D([], [], color="#bbb", lw=0.8, ls=":", label="dependency also implied by a path")]
    ax.legend(handles=handles, loc="lower left", fontsize=9, frameon=True)
    ax.set_title("DSv4 merge plan: slices by publication round (arrows: base → dependent)", fontsize=12)
    ax.axis("off")
    ys = [p[1] for p in pos.values()]
    ax.set_ylim(min(ys) - 2.2, max(ys) + 1.4)
    fig.tight_layout()
    try:
        return atomic_savefig(fig, path)
    finally:
        plt.close(fig)
