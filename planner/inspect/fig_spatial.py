"""The layer placement of a 3D CNN's hybrid data + spatial plan: how each layer's volume is split.

One bar per top-level layer in model order, as tall as its spatial degree (log scale; 1 = unsplit, data
parallel only), coloured by the dims it splits, labelled with its grid (``d4xh2``); the title names the mesh.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from planner.plan import Plan, plan_label

DIM_COLORS = {"": "#bbbbbb", "d": "#4c72b0", "dh": "#55a868", "dhw": "#c44e52", "h": "#8172b2", "w": "#ccb974"}


def is_spatial(plan: Plan) -> bool:
    return "sd" in plan.mesh.axes


def plot_spatial_placement(plan: Plan) -> Figure:
    """Spatial split per layer (module docstring); gid ``module:<path>`` on every bar."""
    paths = [p for st in sorted(plan.stages, key=lambda s: s.index) for p in st.module_paths]
    fig = Figure(figsize=(min(16.0, max(7.0, 2.5 + 0.35 * len(paths))), 3.6), layout="constrained")
    ax = fig.add_subplot()
    for i, path in enumerate(paths):
        lay = plan.layout.get(path)
        split = lay.spatial if lay is not None else None
        degree = split.degree if split else 1
        dims = "".join(split.dims) if split else ""
        ax.bar(i, degree, color=DIM_COLORS.get(dims, "#937860"), edgecolor="white", gid=f"module:{path}")
        label = "x".join(f"{d}{g}" for d, g in zip("dhw", split.grid) if g > 1) if split else "dp"
        ax.text(i, degree * 1.05, label, ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_yscale("log", base=2)
    ax.set_ylim(0.8, max(2, plan.mesh.size("sd")) * 4)
    ax.set_xticks(range(len(paths)), paths, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.6, len(paths) - 0.4)
    ax.set_xlabel("top-level module, in model order (module path)")
    ax.set_ylabel("spatial degree (ranks per sample)")
    ax.set_title(f"{plan_label(plan)}: spatial split per layer (mesh dp x sd)", fontsize=10)
    used = {"".join(lay.spatial.dims) for lay in plan.layout.values() if lay.spatial} | {""}
    handles = [
        Patch(facecolor=DIM_COLORS.get(d, "#937860"), label=f"split along {d}" if d else "unsplit (data parallel)")
        for d in sorted(used, key=len)
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
