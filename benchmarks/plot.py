"""Draw the benchmark results, memguard against each peer, as one figure.

``python benchmarks/plot.py`` draws the measured figures kept in ``benchmarks/figures.json``
(those of the latest full run, as the documentation quotes them) into
``docs/_static/benchmarks.png``. ``python benchmarks/plot.py benchmarks/results.json`` draws a
run of ``python -m benchmarks`` instead: every result that has a peer, as memguard's figure
over the peer's. ``--output`` names another file. ``python benchmarks/plot.py --mixed`` draws
benchmark 12's per-batch record (``benchmarks/mixed_lengths.json``, kept by a full run of it) into
``docs/_static/mixed_lengths.png``: each batch's tokens, and the slices memguard ran it in
beside the sample-counted run's. Needs matplotlib (``memguard-ml[plot]``).
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
MIXED = os.path.join(ROOT, "benchmarks", "mixed_lengths.json")
MIXED_OUTPUT = os.path.join(ROOT, "docs", "_static", "mixed_lengths.png")
# the rung each batch of benchmark 12 ended on, and the sample-counted run's bars
RUNGS = {"plain": "#2a7ab0", "split": "#7fb8dc", "failed pass": "#c8553d",
         "recompute": "#8a5fb0"}
COUNTED = "#b0b0b0"
RUNG_NAMES = {"plain": "whole", "split": "split as planned",
              "failed pass": "split after a failed pass", "recompute": "recomputed"}
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


def rung(attempts: list[list]) -> str:
    """What a batch of benchmark 12 ended on, from its attempts ``[size, ok, slices,
    recompute]``: ``"plain"`` (one pass, whole), ``"split"`` (one pass, in slices planned
    before it ran), ``"failed pass"`` (a pass ran out of memory first), ``"recompute"``."""
    if any(a[3] for a in attempts):
        return "recompute"
    if any(not a[1] for a in attempts):
        return "failed pass"
    return "plain" if attempts[-1][2] == 1 else "split"


def slices_of(attempts: list[list]) -> int:
    """The slices of the pass that fitted (0 where none did)."""
    return next((a[2] for a in attempts if a[1]), 0)


def draw_mixed(record: dict, output: str) -> str:
    """Benchmark 12, per batch: its tokens (top), the slices memguard ran it in, coloured by
    the rung it ended on, beside the sample-counted run's slices (bottom); returns the
    path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = record["batches"]
    xs = list(range(1, len(batches) + 1))
    mine = [slices_of(b["cost"]) for b in batches]
    counted = [slices_of(b["samples"]) for b in batches]
    rungs = [rung(b["cost"]) for b in batches]
    failed = [sum(1 for a in b["cost"] if not a[1]) for b in batches]
    failed_counted = sum(1 for b in batches for a in b["samples"] if not a[1])
    plt.rcParams.update({"font.size": 10})
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 5.6), sharex=True,
                                      gridspec_kw={"height_ratios": [1, 1.3]})
    top.bar(xs, [b["tokens"] for b in batches], color="#5b8c5a", width=0.7)
    top.set_ylabel("tokens\nin the batch")
    top.set_title(f"Benchmark 12: {len(batches)} batches of {record['batch']} sequences, "
                  f"{record['budget_mib']} MiB budget", fontsize=10)
    width = 0.38
    bottom.bar([x - width / 2 for x in xs], mine, width, color=[RUNGS[r] for r in rungs])
    bottom.bar([x + width / 2 for x in xs], counted, width, color=COUNTED)
    bottom.plot([x - width / 2 for x in xs], [b["best"] for b in batches], "_", color="black",
                markersize=9, markeredgewidth=1.5)
    for x, n, fails in zip(xs, mine, failed, strict=True):
        if fails:
            bottom.text(x - width / 2, n + 0.08, f"{fails} failed", ha="center", va="bottom",
                        color=RUNGS["failed pass"], fontsize=10)
    bottom.set_ylabel("slices run")
    bottom.set_xlabel("batch")
    bottom.set_xticks([1, *range(4, len(xs) + 1, 4)])
    bottom.set_ylim(0, max(mine + counted) + 0.6)
    bottom.set_yticks(range(max(mine + counted) + 1))
    shown = [r for r in RUNGS if r in rungs]
    handles = [plt.Rectangle((0, 0), 1, 1, color=RUNGS[r]) for r in shown]
    handles += [plt.Rectangle((0, 0), 1, 1, color=COUNTED),
                plt.Line2D([], [], marker="_", linestyle="", color="black", markersize=9,
                           markeredgewidth=1.5)]
    labels = [f"memguard, {RUNG_NAMES[r]}" for r in shown] + [
        "counted in samples", "per-batch best"]
    fig.legend(handles, labels, fontsize=10, loc="lower center", ncol=2, frameon=False,
               bbox_to_anchor=(0.5, 0.06))
    fig.text(0.5, 0.01, f"slices: memguard {sum(mine)} ({sum(failed)} failed "
             f"pass{'es' if sum(failed) != 1 else ''}), counted in samples {sum(counted)} "
             f"({failed_counted} failed), per-batch best {sum(b['best'] for b in batches)}",
             fontsize=10, ha="center")
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", nargs="?", default=FIGURES,
                        help="benchmarks/figures.json (default) or a results.json")
    parser.add_argument("--output", default=None,
                        help=f"default {OUTPUT}, or {MIXED_OUTPUT} with --mixed")
    parser.add_argument("--mixed", action="store_true",
                        help="draw benchmark 12's per-batch record (figures then defaults to "
                             "benchmarks/mixed_lengths.json)")
    args = parser.parse_args(argv)
    if args.mixed:
        path = MIXED if args.figures == FIGURES else args.figures
        with open(path) as f:
            record = json.load(f)
        print(f"written {draw_mixed(record, args.output or MIXED_OUTPUT)}")
        return 0
    args.output = args.output or OUTPUT
    panels, source = load(args.figures)
    print(f"written {draw(panels, source, args.output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
