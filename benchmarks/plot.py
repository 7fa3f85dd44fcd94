"""Draw the benchmark results, memguard against each peer, as one figure.

``python benchmarks/plot.py`` draws the measured figures kept in ``benchmarks/figures.json``
(those of the latest full run, as the documentation quotes them) into
``docs/_static/benchmarks.png``. ``python benchmarks/plot.py benchmarks/results.json`` draws a
run of ``python -m benchmarks`` instead: every result that has a peer, as memguard's figure
over the peer's. ``--output`` names another file. Needs matplotlib (``memguard-ml[plot]``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import ROOT

FIGURES = os.path.join(ROOT, "benchmarks", "figures.json")
OUTPUT = os.path.join(ROOT, "docs", "_static", "benchmarks.png")
COLOURS = {"memguard": "#2a7ab0", "peer": "#c8553d"}


def panels_of_results(results: dict) -> list[dict]:
    """The panels of a ``results.json``: one bar pair per result that has a peer figure."""
    panels = []
    for r in results["results"]:
        if r.get("peer") is None:
            continue
        panels.append({"peer": r["peer_name"], "benchmark": r["name"].split()[0],
                       "metric": f"{r['name']} ({r['unit']})",
                       "bars": [{"label": "memguard", "who": "memguard", "value": r["memguard"]},
                                {"label": r["peer_name"], "who": "peer", "value": r["peer"]}]})
    return panels


def load(path: str) -> tuple[list[dict], str]:
    """The panels to draw and the line that says where the figures come from."""
    with open(path) as f:
        data = json.load(f)
    if "panels" in data:
        return data["panels"], data.get("source", path)
    if "results" in data:
        machine = data.get("machine", {})
        quick = " --quick" if data.get("quick") else ""
        return panels_of_results(data), (f"python -m benchmarks{quick}, "
                                         f"torch {machine.get('torch', '?')}")
    raise ValueError(f"{path}: neither a figures file (\"panels\") nor a results file "
                     f"(\"results\"); give benchmarks/figures.json or a results.json that "
                     f"python -m benchmarks wrote")


def draw(panels: list[dict], source: str, output: str) -> str:
    """Draw ``panels`` (horizontal bars, memguard's and the peer's in two colours) to
    ``output``; returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("nothing to draw: no result has a peer figure")
    columns = 2
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(13, 3.0 * rows + 1.0), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        bars = panel["bars"]
        labels = [b["label"] for b in bars]
        values = [b["value"] for b in bars]
        ys = range(len(bars))[::-1]
        ax.barh(list(ys), values, color=[COLOURS[b["who"]] for b in bars])
        ax.set_yticks(list(ys), labels, fontsize=8)
        ax.set_title(f"{panel['metric']}, benchmark {panel['benchmark']}\n"
                     f"against {panel['peer']}", fontsize=9)
        top = max(values) or 1
        ax.set_xlim(0, top * 1.25)
        for y, v in zip(ys, values, strict=True):
            ax.text(v + top * 0.01, y, f"{v:g}", va="center", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, ["memguard", "peer"], loc="upper left", fontsize=9)
    fig.suptitle("memguard against its peers\n" + textwrap.fill(source, 110), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", nargs="?", default=FIGURES,
                        help="benchmarks/figures.json (default) or a results.json")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    panels, source = load(args.figures)
    print(f"written {draw(panels, source, args.output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
