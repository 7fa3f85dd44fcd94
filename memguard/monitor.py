"""``MemoryMonitor``: a timeline of memory, sampled by a background thread, with marks."""

from __future__ import annotations

import csv
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

from ._checks import positive_int, positive_number
from ._events import listen, unlisten
from ._locks import ForkSafeLock
from .backends import UNKNOWN, DeviceMemory, Devices, Reading, resolve_devices
from .backends.host import HOST, address_space
from .cleanup import Pairs, Readings

if TYPE_CHECKING:  # matplotlib is optional (the plot extra), imported by figure() itself
    import matplotlib.figure

log = logging.getLogger("memguard")

MAX_LISTED_MARKS = 40  # marks numbered on a plot and listed beside it; the rest are bare lines
_LABEL_ROWS = 3  # rows the numbers of marks are staggered in
_LABEL_PX = 22  # room one number takes across, in pixels at 100 dpi
_LISTED_CHARS = 48  # a mark's label beside the plot is cut to this

# (virtual size, soft RLIMIT_AS, who set it) at one sample; None where no limit was in force
Space = Optional[tuple[int, int, str]]


class MemoryMonitor:
    """Samples every watched device every ``interval`` seconds on a daemon thread.

    A context manager (or ``start()`` / ``stop()``). ``samples`` is a list of ``(time,
    {device: DeviceMemory})`` with ``allocated`` and ``reserved``; ``peak`` maps each device
    to the highest level seen; ``mark(label)`` adds a labelled moment (scopes and
    ``oom_retry`` attempts inside add their own). A monitor started again continues its
    timeline. Under a soft ``RLIMIT_AS`` the host's virtual size is sampled too
    (:meth:`address_space`). A device that cannot be read gives ``None`` figures, counted in
    ``failed_readings``.

    Memory stays bounded: at ``max_samples`` adjacent samples merge in pairs (keeping the
    larger figures, so no spike is lost); past ``max_marks`` the first half and the latest
    marks stay, and ``marks_dropped`` counts the rest.

    Args:
        interval: seconds between samples. Default ``0.1``.
        devices: the devices to watch (a name, a list of names, or ``None`` for all).
        max_samples: the most samples kept (at least 2; about 520 bytes each with one
            device). Default ``100_000``.
        max_marks: the most marks kept (at least 2; about 150 bytes each).
            Default ``10_000``.

    >>> import memguard
    >>> with memguard.MemoryMonitor(interval=0.01, max_samples=1000, max_marks=10) as mon:
    ...     for step in range(20):
    ...         mon.mark(f"step {step}")
    >>> [label for _, label in mon.marks][4:6], mon.marks_dropped
    (['step 4', 'step 15'], 10)
    >>> len(mon.samples) <= 1000
    True
    """

    def __init__(self, interval: float = 0.1, devices: Devices = None,
                 max_samples: int = 100_000, max_marks: int = 10_000) -> None:
        self.interval = positive_number(interval, "interval", unit="seconds",
                                        who="MemoryMonitor", hint="; for example interval=0.1")
        positive_int(max_samples, "max_samples", minimum=2, who="MemoryMonitor",
                     hint="; the default, 100000, is about 50 MiB")
        positive_int(max_marks, "max_marks", minimum=2, who="MemoryMonitor",
                     hint="; the default, 10000, is about 1.5 MiB")
        self.devices = devices
        self.max_samples = max_samples
        self.max_marks = max_marks
        self.samples: list[tuple[float, dict[str, DeviceMemory]]] = []
        self._space: list[Space] = []  # beside samples, one for one
        self._stride = 1  # readings per sample (doubles at each halving)
        self._filled = 0  # readings folded into the last sample
        self.marks: list[tuple[float, str]] = []
        self.marks_dropped = 0
        self._dropped_between: Optional[tuple[float, float]] = None
        self.failed_readings: dict[str, int] = {}
        self._readings = 0
        self.peak: dict[str, int] = {}
        self.started: Optional[float] = None
        self._pairs: Pairs = []
        self._host = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = ForkSafeLock()

    # -- running -------------------------------------------------------------------------------
    def start(self) -> "MemoryMonitor":
        """Start sampling (a second start while running is an error)."""
        if self._thread is not None:
            raise RuntimeError("MemoryMonitor is already running")
        self._pairs = resolve_devices(self.devices)
        self._host = any(device == HOST for _, device in self._pairs)
        self.failed_readings, self._readings = {}, 0
        self._stop.clear()
        if self.started is None:  # a restart continues the timeline: times stay monotonic
            self.started = time.time()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="memguard-monitor", daemon=True)
        self._thread.start()
        listen(self.mark)
        return self

    def stop(self) -> None:
        """Stop sampling, after one last sample; waits at most one interval."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        unlisten(self.mark)
        self._stop.set()
        thread.join()
        self._sample()
        for device, failed in self.failed_readings.items():
            log.warning("MemoryMonitor: reading %s failed %d time%s of %d", device, failed,
                        "" if failed == 1 else "s", self._readings)

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __repr__(self) -> str:
        devices = self.devices if self.devices is not None else "every device"
        state = "running" if self._thread is not None else "stopped"
        return (f"<MemoryMonitor every {self.interval:g} s on {devices}, {state}, "
                f"{len(self.samples)} samples, {len(self.marks)} marks>")

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()

    def _run(self) -> None:
        # Deadlines, not sleeps: the time spent waiting for the interpreter lock and sampling
        # does not stretch the interval. A sampler that fell behind skips, never bursts.
        due = time.monotonic() + self.interval
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            self._sample()
            due += self.interval
            now = time.monotonic()
            if due <= now:
                due = now + self.interval

    def _read(self) -> Readings:
        """A fast reading of each device; a failure reads as unknown, logged once, then counted."""
        out: Readings = {}
        for backend, device in self._pairs:
            try:
                out[device] = backend.read_fast(device)
            except Exception as exc:  # noqa: BLE001 - a failed reading must not end the timeline
                out[device] = UNKNOWN
                with self._lock:
                    failed = self.failed_readings[device] = self.failed_readings.get(device, 0) + 1
                if failed == 1:
                    log.warning("MemoryMonitor: cannot read %s: %s (later failures are counted "
                                "and reported when the monitor stops)", device, exc)
        self._readings += 1
        return out

    def _sample(self) -> None:
        now = time.time()
        readings = self._read()
        space = address_space() if self._host else None
        memory = {d: DeviceMemory(d, allocated=r.allocated, reserved=r.reserved)
                  for d, r in readings.items()}
        with self._lock:
            self._record(now, memory, space)
            for backend, device in self._pairs:
                level = backend.level(readings[device])
                if level is not None and level > self.peak.get(device, -1):
                    self.peak[device] = level

    def _record(self, now: float, memory: dict[str, DeviceMemory], space: Space = None) -> None:
        """Add a reading (lock held): folded into the last sample until it holds ``_stride``
        readings; at ``max_samples``, halve the resolution."""
        if self.samples and self._filled < self._stride:
            self.samples[-1] = (now, _merge(self.samples[-1][1], memory))
            self._space[-1] = _merge_space(self._space[-1], space)
            self._filled += 1
        elif len(self.samples) < self.max_samples:
            self.samples.append((now, memory))
            self._space.append(space)
            self._filled = 1
        else:
            old, spaces = self.samples, self._space
            odd = len(old) % 2  # an unpaired last sample keeps its readings and stays open
            pairs = zip(old[::2], old[1::2], strict=False)  # the odd one out is kept below
            self.samples[:] = [(b[0], _merge(a[1], b[1])) for a, b in pairs] + old[len(old) - odd:]
            self._space[:] = [_merge_space(a, b) for a, b in zip(
                spaces[::2], spaces[1::2], strict=False)] + spaces[len(spaces) - odd:]
            self._filled = self._stride * (1 if odd else 2)
            self._stride *= 2
            self._record(now, memory, space)

    def mark(self, label: str) -> None:
        """Add a labelled moment to the timeline (a vertical line in ``plot``).

        Args:
            label: what happened (any object: kept as its ``str``).
        """
        with self._lock:
            if len(self.marks) >= self.max_marks:
                dropped = self.marks.pop(self.max_marks // 2)[0]
                self.marks_dropped += 1
                first = self._dropped_between[0] if self._dropped_between else dropped
                self._dropped_between = (first, dropped)
            self.marks.append((time.time(), str(label)))

    # -- export --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Samples, marks and peaks as a JSON-ready dict."""
        with self._lock:
            return {
                "interval": self.interval, "max_samples": self.max_samples,
                "started": self.started, "peak": dict(self.peak),
                "samples": [{"time": t, "devices": {d: m.to_dict() for d, m in mem.items()}}
                            for t, mem in self.samples],
                "marks": [{"time": t, "label": label} for t, label in self.marks],
                "marks_dropped": self.marks_dropped,
                "failed_readings": dict(self.failed_readings),
                "address_space": [{"time": t, "virtual": space[0], "limit": space[1],
                                   "kind": space[2]}
                                  for (t, _), space in zip(self.samples, self._space, strict=True)
                                  if space is not None],
            }

    def to_csv(self, path: str) -> None:
        """One row per sample and device (``time,device,allocated,reserved,mark``), one per mark.

        Args:
            path: the CSV file to write (replaced if it exists); ``time`` in seconds since the
                start, ``allocated`` and ``reserved`` in bytes.
        """
        with self._lock, open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["time", "device", "allocated", "reserved", "mark"])
            rows: list[tuple[float, str, Any, Any, str]] = [
                (t, d, m.allocated, m.reserved, "") for t, mem in self.samples
                for d, m in mem.items()]
            rows += [(t, "", "", "", label) for t, label in self.marks]
            for row in sorted(rows, key=lambda r: r[0]):
                writer.writerow(["" if v is None else v for v in row])

    def series(self) -> dict[str, dict[str, list[tuple[float, int]]]]:
        """``device -> {"allocated"|"reserved": [(seconds since start, bytes), ...]}``."""
        start = self.started or 0.0
        out: dict[str, dict[str, list[tuple[float, int]]]] = {}
        with self._lock:
            for t, mem in self.samples:
                for device, m in mem.items():
                    lines = out.setdefault(device, {"allocated": [], "reserved": []})
                    for field in ("allocated", "reserved"):
                        value = getattr(m, field)
                        if value is not None:
                            lines[field].append((t - start, value))
        return out

    def address_space(self) -> list[tuple[float, int, int, str]]:
        """The host's address space at each sample taken under a soft ``RLIMIT_AS``.

        Returns:
            ``(seconds since start, virtual size, limit, kind)`` tuples in time order, bytes;
            ``kind`` is ``"memory_limit"`` (set by :func:`memguard.memory_limit`) or
            ``"RLIMIT_AS"``. Empty when no such limit was in force.

        >>> import time, memguard
        >>> with memguard.MemoryMonitor(interval=0.01, devices="host") as mon:
        ...     with memguard.memory_limit("4GiB", device="host"):
        ...         time.sleep(0.05)
        >>> seconds, virtual, limit, kind = mon.address_space()[-1]
        >>> kind, virtual <= limit
        ('memory_limit', True)
        """
        start = self.started or 0.0
        with self._lock:
            return [(t - start, *space) for (t, _), space
                    in zip(self.samples, self._space, strict=True) if space is not None]

    def figure(self, title: Optional[str] = None,
               lines: Optional[dict[str, list[tuple[int, str]]]] = None,
               marks: Optional[Iterable[tuple[float, str]]] = None
               ) -> matplotlib.figure.Figure:
        """The timeline as a matplotlib ``Figure`` (what :meth:`plot` writes).

        One panel per device: ``allocated`` (solid) and ``reserved`` (dashed) in MiB, plus the
        host's address space under a soft ``RLIMIT_AS``. Marks are vertical lines; up to
        ``MAX_LISTED_MARKS`` are numbered and listed beside the plot.

        Args:
            title: the title (default "memguard memory timeline").
            lines: horizontal lines per panel, ``{"cuda:0": [(bytes, "budget")]}``.
                Default ``None``: no lines.
            marks: the marks to draw, ``(time.time(), label)`` pairs (default: ``marks``).

        Returns:
            a ``matplotlib.figure.Figure`` with its own Agg canvas (pyplot is not involved).
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.collections import LineCollection
            from matplotlib.figure import Figure
            from matplotlib.transforms import offset_copy
        except ImportError as exc:
            raise ImportError('MemoryMonitor.plot needs matplotlib: pip install "memguard-ml[plot]"'
                              ) from exc
        series = self.series()
        space = self.address_space()
        lines = lines or {}
        with self._lock:
            chosen = list(self.marks if marks is None else marks)
            dropped, between = self.marks_dropped, self._dropped_between
        # Seconds since the start (a monitor never started: since its first mark).
        start = self.started or min((t for t, _ in chosen), default=0.0)
        times = sorted((t - start, str(label)) for t, label in chosen)
        panels = list(series)
        if space:
            where = panels.index(HOST) + 1 if HOST in panels else len(panels)
            panels.insert(where, "host address space")
        # A Figure with its own Agg canvas: pyplot's global state and the program's chosen
        # backend stay as they are. Tall enough for the list of marks beside it.
        listed_rows = min(len(times), MAX_LISTED_MARKS) + 4
        height = max(3.4 * max(1, len(panels)), 0.6 + listed_rows * 7 * 1.3 / 72)
        fig = Figure(figsize=(12, height))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(panels) or 1, 1, squeeze=False, sharex=True)[:, 0]
        for ax, panel in zip(axes, panels, strict=False):
            if panel == "host address space":
                _draw_address_space(ax, space)
            else:
                for field, style in (("allocated", "-"), ("reserved", "--")):
                    if series[panel][field]:
                        xs, ys = zip(*series[panel][field], strict=True)
                        ax.plot(xs, [y / 2**20 for y in ys], style, label=field)
                ax.set_ylabel(f"{panel} (MiB)")
            for level, label in lines.get(panel, []):
                ax.axhline(level / 2**20, color="tab:red", linewidth=1.2, linestyle=":",
                           label=label)
            if ax.has_data():
                ax.legend(loc="lower right", fontsize=8)
        axes[-1].set_xlabel("seconds")
        fig.suptitle(title or "memguard memory timeline")
        fig.tight_layout(rect=(0, 0, 0.68, 1) if times else (0, 0, 1, 1))
        if not times:
            return fig
        # Numbers go where the layout put the axes: spread so that none overlaps another.
        top = axes[0]
        low, high = top.get_xlim()
        numbered = _spread([t for t, _ in times], low, high, top.get_window_extent().width)
        rest = [t for i, (t, _) in enumerate(times) if i not in numbered]
        faint = 0.3 if len(rest) < 200 else 0.12  # many lines would hide the data
        for ax in axes:
            for at, shade in ((rest, faint), ([times[i][0] for i in numbered], 0.6)):
                if at:
                    ax.add_collection(LineCollection(
                        [[(x, 0), (x, 1)] for x in at], colors="grey", linewidths=0.6,
                        alpha=shade, transform=ax.get_xaxis_transform(), zorder=1),
                        autolim=False)
            ax.set_xlim(low, high)
        for number, (index, row) in enumerate(sorted(numbered.items()), 1):
            # Rows a fixed number of points apart below the top, whatever the panel's height.
            place = offset_copy(top.get_xaxis_transform(), fig=fig, y=-3 - 11 * row,
                                units="points")
            text = top.text(times[index][0], 1, str(number), fontsize=7, ha="center", va="top",
                            color="dimgrey", transform=place,
                            bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none",
                                      alpha=0.8))
            text.set_in_layout(False)
        # Few marks: all listed in time order, those without a number beside the one before
        # them. Many: the numbered ones, and a count of the rest.
        digits = min(3, max(1, math.ceil(-math.log10(max(high - low, 1e-3) / 100))))
        number_of = {index: n for n, index in enumerate(sorted(numbered), 1)}
        shown = range(len(times)) if len(times) <= MAX_LISTED_MARKS else sorted(numbered)
        listing = [f"{number_of.get(i, '-'):>2}  {times[i][0]:7.{digits}f} s  "
                   f"{_cut(times[i][1])}" for i in shown]
        if len(times) > len(shown):
            listing.append(f"+ {len(times) - len(shown)} more marks (lines without numbers)")
        if dropped and marks is None and between is not None:
            listing.append(f"{dropped} marks dropped between {between[0] - start:.{digits}f} s "
                           f"and {between[1] - start:.{digits}f} s (max_marks)")
        fig.text(0.695, 0.9, "marks\n" + "\n".join(listing), fontsize=7, family="monospace",
                 va="top")
        return fig

    def plot(self, path: str, title: Optional[str] = None,
             lines: Optional[dict[str, list[tuple[int, str]]]] = None,
             marks: Optional[Iterable[tuple[float, str]]] = None) -> str:
        """Write the timeline of :meth:`figure` as a PNG. Needs matplotlib
        (``pip install "memguard-ml[plot]"``).

        Args:
            path: the PNG file to write (its folder must exist).
            title: the title (default "memguard memory timeline").
            lines: horizontal lines per panel, ``{"cuda:0": [(bytes, "budget")]}``.
                Default ``None``: no lines.
            marks: the marks to draw, ``(time.time(), label)`` pairs (default: ``marks``).

        Returns:
            ``path``.
        """
        self.figure(title, lines, marks).savefig(path, dpi=100)
        return path

    def to_tensorboard(self, writer: Any, prefix: str = "memory") -> int:
        """Write the series as scalars (``memory/<device>/allocated`` in MiB, step = sample index).

        Args:
            writer: a ``torch.utils.tensorboard.SummaryWriter`` (anything with ``add_scalar``)
                or a TensorFlow summary writer (``tf.summary.create_file_writer``).
            prefix: the first part of every tag. Default ``"memory"``.

        Returns:
            The number of scalars written.
        """
        rows = [(f"{prefix}/{device}/{field}", index, t, value / 2**20)
                for index, (t, mem) in enumerate(list(self.samples))
                for device, m in mem.items()
                for field in ("allocated", "reserved")
                for value in [getattr(m, field)] if value is not None]
        if hasattr(writer, "add_scalar"):
            for tag, step, walltime, value in rows:
                writer.add_scalar(tag, value, global_step=step, walltime=walltime)
            writer.flush()
        elif hasattr(writer, "as_default"):
            from .backends.tensorflow import write_scalars

            write_scalars(writer, [(tag, step, value) for tag, step, _, value in rows])
        else:
            raise TypeError(f"to_tensorboard needs a torch SummaryWriter or a TensorFlow summary "
                            f"writer, got {type(writer).__name__}")
        return len(rows)


def _merge(a: dict[str, DeviceMemory], b: dict[str, DeviceMemory]) -> dict[str, DeviceMemory]:
    """Two samples as one: per device, the larger ``allocated`` and ``reserved``."""
    out = dict(a)
    for device, m in b.items():
        old = out.get(device)
        if old is None:
            out[device] = m
        else:
            high = Reading(old.allocated, old.reserved).higher(Reading(m.allocated, m.reserved))
            out[device] = DeviceMemory(device, allocated=high.allocated, reserved=high.reserved)
    return out


def _merge_space(a: Space, b: Space) -> Space:
    """Two address-space readings as one: the larger virtual size, the tighter limit."""
    if a is None or b is None:
        return b if a is None else a
    return max(a[0], b[0]), *min(a[1:], b[1:])


def _draw_address_space(ax: Any, space: list[tuple[float, int, int, str]]) -> None:
    """The virtual size and the soft ``RLIMIT_AS`` over time, in MiB, on ``ax``."""
    xs = [t for t, *_ in space]
    ax.plot(xs, [vm / 2**20 for _, vm, _, _ in space], "-", color="tab:purple",
            label="virtual size")
    kinds = sorted({kind for *_, kind in space if kind != "RLIMIT_AS"})
    ax.step(xs, [limit / 2**20 for _, _, limit, _ in space], where="post", color="tab:red",
            linewidth=1.2, linestyle=":", label="soft RLIMIT_AS" + "".join(
                f" (set by {kind})" for kind in kinds))
    ax.set_ylabel("host address space (MiB)")


def _spread(xs: list[float], low: float, high: float, width_px: float) -> dict[int, int]:
    """Which of the sorted ``xs`` get a number, and in which row (``{index: row}``): at most
    ``MAX_LISTED_MARKS``, none overlapping, spread over the whole span."""
    span = max(high - low, 1e-9)
    gap = span * _LABEL_PX / max(width_px, 1.0)  # within a row
    step = 0.0  # between any two numbers
    if len(xs) > MAX_LISTED_MARKS:
        step = span / MAX_LISTED_MARKS
        gap = max(gap, step * _LABEL_ROWS)
    last = [-math.inf] * _LABEL_ROWS
    previous = -math.inf
    chosen: dict[int, int] = {}
    for index, x in enumerate(xs):
        if len(chosen) == MAX_LISTED_MARKS:
            break
        if x - previous < step or not low <= x <= high:
            continue
        row = next((r for r in range(_LABEL_ROWS) if x - last[r] >= gap), None)
        if row is not None:
            last[row] = previous = x
            chosen[index] = row
    return chosen


def _cut(label: str) -> str:
    """A mark's label for the list beside the plot: one line, at most ``_LISTED_CHARS``."""
    label = " ".join(label.split())
    return label if len(label) <= _LISTED_CHARS else label[:_LISTED_CHARS - 3] + "..."
