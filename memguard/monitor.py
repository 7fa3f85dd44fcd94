"""``MemoryMonitor``: a timeline of memory, sampled by a background thread, with marks."""

from __future__ import annotations

import csv
import threading
import time
from typing import Any, Optional

from ._checks import positive_int, positive_number
from ._events import listen, unlisten
from ._locks import ForkSafeLock
from .backends import DeviceMemory, Devices, Reading, resolve_devices
from .cleanup import Pairs, read_all

MAX_LISTED_MARKS = 40  # marks listed beside a plot; later ones are counted


class MemoryMonitor:
    """Samples every watched device every ``interval`` seconds on a daemon thread.

    A context manager (or ``start()`` / ``stop()``). ``samples`` is a list of ``(time,
    {device: DeviceMemory})`` with ``allocated`` and ``reserved`` (the cheap readings: a few
    microseconds a device); ``peak`` maps each device to the highest level seen (the resident
    set on the host, ``allocated`` on devices); ``mark(label)`` adds a labelled moment, and
    scopes and ``oom_retry`` attempts inside a running monitor add their own. The thread
    stops within one interval of ``stop()``, also when the body raised.

    Memory stays bounded on runs of any length: at ``max_samples`` samples (about 520 bytes
    each with one device) adjacent samples merge in pairs, halving the resolution of the
    whole timeline, and later readings fold into samples of that coarser step. A merged
    sample keeps the larger ``allocated`` and ``reserved`` of the two (a spike is never
    lost) and the later time (the last sample is always the latest reading). Marks and
    ``peak`` are kept in full.

    >>> import memguard
    >>> with memguard.MemoryMonitor(interval=0.01, max_samples=1000) as mon:
    ...     mon.mark("start")
    >>> mon.marks[0][1]
    'start'
    >>> len(mon.samples) <= 1000
    True
    """

    def __init__(self, interval: float = 0.1, devices: Devices = None,
                 max_samples: int = 100_000) -> None:
        self.interval = positive_number(interval, "interval", unit="seconds",
                                        who="MemoryMonitor", hint="; for example interval=0.1")
        positive_int(max_samples, "max_samples", minimum=2, who="MemoryMonitor",
                     hint="; the default, 100000, is about 50 MiB")
        self.devices = devices
        self.max_samples = max_samples
        self.samples: list[tuple[float, dict[str, DeviceMemory]]] = []
        self._stride = 1  # readings per sample (doubles at each halving)
        self._filled = 0  # readings folded into the last sample
        self.marks: list[tuple[float, str]] = []
        self.peak: dict[str, int] = {}
        self.started: Optional[float] = None
        self._pairs: Pairs = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._lock = ForkSafeLock()

    # -- running -------------------------------------------------------------------------------
    def start(self) -> "MemoryMonitor":
        """Start sampling (a second start while running is an error)."""
        if self._thread is not None:
            raise RuntimeError("MemoryMonitor is already running")
        self._pairs = resolve_devices(self.devices)
        self._stop.clear()
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

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

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

    def _sample(self) -> None:
        now = time.time()
        readings = read_all(self._pairs)
        memory = {d: DeviceMemory(d, allocated=r.allocated, reserved=r.reserved)
                  for d, r in readings.items()}
        with self._lock:
            self._record(now, memory)
            for backend, device in self._pairs:
                level = backend.level(readings[device])
                if level is not None and level > self.peak.get(device, -1):
                    self.peak[device] = level

    def _record(self, now: float, memory: dict[str, DeviceMemory]) -> None:
        """Add a reading to the timeline (the caller holds the lock): folded into the last
        sample until it holds ``_stride`` readings; at ``max_samples``, halve the resolution."""
        if self.samples and self._filled < self._stride:
            self.samples[-1] = (now, _merge(self.samples[-1][1], memory))
            self._filled += 1
        elif len(self.samples) < self.max_samples:
            self.samples.append((now, memory))
            self._filled = 1
        else:
            old = self.samples
            odd = len(old) % 2  # an unpaired last sample keeps its readings and stays open
            pairs = zip(old[::2], old[1::2], strict=False)  # the odd one out is kept below
            self.samples[:] = [(b[0], _merge(a[1], b[1])) for a, b in pairs] + old[len(old) - odd:]
            self._filled = self._stride * (1 if odd else 2)
            self._stride *= 2
            self._record(now, memory)

    def mark(self, label: str) -> None:
        """Add a labelled moment to the timeline (drawn as a vertical line by ``plot``)."""
        with self._lock:
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
            }

    def to_csv(self, path: str) -> None:
        """One row per sample and device (``time,device,allocated,reserved,mark``), and one
        row per mark."""
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

    def plot(self, path: str, title: Optional[str] = None,
             lines: Optional[dict[str, list[tuple[int, str]]]] = None) -> str:
        """Write a PNG of allocated and reserved memory per device over time. Marks are
        numbered vertical lines, listed with their times beside the plot (labels of marks
        close together would overlap); ``lines`` draws horizontal lines per device
        (``{"host": [(bytes, "budget")]}``). Needs matplotlib (``pip install
        "memguard[plot]"``)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as exc:
            raise ImportError('MemoryMonitor.plot needs matplotlib: pip install "memguard[plot]"'
                              ) from exc
        series = self.series()
        lines = lines or {}
        # A Figure with its own Agg canvas: pyplot's global state and the program's chosen
        # backend stay as they are.
        fig = Figure(figsize=(12, 3.4 * max(1, len(series))))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(series) or 1, 1, squeeze=False)
        start = self.started or 0.0
        marks = [(t - start, label) for t, label in self.marks]
        for ax, (device, found) in zip(axes[:, 0], series.items(), strict=False):
            for field, style in (("allocated", "-"), ("reserved", "--")):
                if found[field]:
                    xs, ys = zip(*found[field], strict=True)
                    ax.plot(xs, [y / 2**20 for y in ys], style, label=field)
            for level, label in lines.get(device, []):
                ax.axhline(level / 2**20, color="tab:red", linewidth=1.2, linestyle=":",
                           label=label)
            top = ax.get_ylim()[1]
            for number, (t, _) in enumerate(marks, 1):
                ax.axvline(t, color="grey", linewidth=0.6, alpha=0.5)
                # Staggered in three rows, so neighbouring numbers do not collide.
                ax.text(t, top * (0.98 - 0.07 * ((number - 1) % 3)), str(number), fontsize=7,
                        ha="center", va="top", color="dimgrey",
                        bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
            ax.set_ylabel(f"{device} (MiB)")
            ax.legend(loc="lower right", fontsize=8)
        axes[-1, 0].set_xlabel("seconds")
        fig.suptitle(title or "memguard memory timeline")
        if marks:
            shown = marks[:MAX_LISTED_MARKS]
            text = "\n".join(f"{n:>2}  {t:6.1f} s  {label[:38]}"
                              for n, (t, label) in enumerate(shown, 1))
            if len(marks) > len(shown):
                text += f"\n... {len(marks) - len(shown)} more"
            fig.text(0.735, 0.9, "marks\n" + text, fontsize=7, family="monospace", va="top")
            fig.tight_layout(rect=(0, 0, 0.72, 1))
        else:
            fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path

    def to_tensorboard(self, writer: Any, prefix: str = "memory") -> int:
        """Write the series as scalars (``memory/<device>/allocated`` in MiB, step = sample
        index) to a ``torch.utils.tensorboard.SummaryWriter`` or a TensorFlow summary writer.
        Returns the number of scalars written."""
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
