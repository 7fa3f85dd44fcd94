"""The ``memguard`` command: ``info``, ``watch`` and ``demo``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from typing import Any, Callable, Optional, Sequence

from . import __version__
from ._checks import positive_int, positive_number
from ._units import format_bytes, format_table, parse_size

ENVIRONMENT = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
               "TF_FORCE_GPU_ALLOW_GROWTH", "TF_GPU_ALLOCATOR", "TF_ENABLE_ONEDNN_OPTS",
               "CUDA_VISIBLE_DEVICES", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")


def _argument(read: Callable[[str], Any], check: Callable[..., Any],
              **options: Any) -> Callable[[str], Any]:
    """An argparse ``type``: the text read, then checked as the API checks it (one message)."""
    def convert(text: str) -> Any:
        try:
            return check(read(text), "the value", **options)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _number(kind: type) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"not a {'whole ' if kind is int else ''}number: {text!r}") from None
    return read


_positive_int = _argument(_number(int), positive_int)
_positive_float = _argument(_number(float), positive_number)
_positive_size = _argument(lambda text: parse_size(text, "the size"), positive_int,
                           hint="; for example 768MiB")


def _demo_budget(text: str) -> int:
    from .demo import check_budget

    try:
        return check_budget(_positive_size(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _plot_path(text: str) -> str:
    """An argparse ``type`` for ``demo --plot``, checked before training (empty: no timeline)."""
    from .demo import check_plot_path

    try:
        return check_plot_path(text) if text else text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    """The command line's parser (every subcommand has ``--help``)."""
    top = argparse.ArgumentParser(prog="memguard", description="Keep GPU and host memory under "
                                  "control in PyTorch and TensorFlow programs.")
    top.add_argument("--version", action="version", version=f"memguard {__version__}")
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = sub.add_parser("info", help="versions, devices, allocator settings",
                          description="Versions, each device's memory, and this environment's "
                                      "allocator settings.")
    info.add_argument("--json", action="store_true", help="print JSON for machines")
    info.add_argument("--no-tensorflow", action="store_true",
                      help="skip TensorFlow (importing it takes seconds)")

    watch = sub.add_parser("watch", help="live memory, one line per sample",
                           description="Print memory per device every INTERVAL seconds until "
                                       "Ctrl-C or COUNT samples.")
    watch.add_argument("--interval", type=_positive_float, default=1.0, metavar="SECONDS")
    watch.add_argument("--count", type=_positive_int, default=None, metavar="N")
    watch.add_argument("--pid", type=_positive_int, default=None,
                       help="watch this process (default: the whole system)")

    demo = sub.add_parser("demo", help="train a small model under a memory budget",
                          description="Train a small model on synthetic data under a memory "
                                      "budget, starting at a batch size that does not fit: "
                                      "oom_retry finds one that does, memory_scope and "
                                      "MemoryMonitor watch the training.")
    demo.add_argument("--budget", type=_demo_budget, default=parse_size("768MiB"),
                      metavar="SIZE", help="memory the training may use (default 768MiB)")
    demo.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    demo.add_argument("--plot", type=_plot_path, default="memguard-demo.png", metavar="PATH",
                      help="where to write the timeline PNG (default memguard-demo.png; its "
                           "folder must exist)")
    demo.add_argument("--epochs", type=_positive_int, default=3, help=argparse.SUPPRESS)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; the exit code (1, quietly, when the output's reader went away)."""
    args = parser().parse_args(argv)
    try:
        if args.command == "info":
            code = info(args.json, tensorflow=not args.no_tensorflow)
            if "tensorflow" in sys.modules and argv is None:
                # Run as the command: nothing is left to clean up, and TensorFlow's teardown
                # at interpreter exit takes seconds (2.2 s of 9 here).
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            return code
        if args.command == "watch":
            return watch(args.interval, args.count, args.pid)
        import logging

        from .demo import run

        logging.getLogger("memguard").addHandler(logging.NullHandler())  # the demo prints
        return run(budget=args.budget, framework=args.framework, plot=args.plot,
                   epochs=args.epochs)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Python's documented recipe: later writes (the flush at exit) go to devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


# -- info ------------------------------------------------------------------------------------------
def collect_info(tensorflow: bool = True) -> dict[str, Any]:
    """What ``memguard info`` shows, as a dict."""
    import psutil

    from .backends import nvml

    vm = psutil.virtual_memory()
    data: dict[str, Any] = {
        "memguard": __version__, "python": platform.python_version(),
        "platform": platform.platform(), "frameworks": {},
        "devices": [{"device": "host", "name": platform.processor() or platform.machine(),
                     "total": int(vm.total), "used": int(vm.total - vm.available),
                     "free": int(vm.available)}],
        "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ},
        "nvml": {"driver": nvml.driver_version(), "gpus": nvml.gpus()},
    }
    if importlib.util.find_spec("torch") is not None:
        from .backends import torch as torch_backend

        data["frameworks"]["torch"] = torch_backend.version()
        data["devices"] += torch_backend.device_overview()
    if tensorflow and importlib.util.find_spec("tensorflow") is not None:
        from .backends import tensorflow as tf_backend

        known = tf_backend.installed_version()
        if known is not None and not tf_backend.gpus_possible() and \
                "tensorflow" not in sys.modules:
            # No GPU driver: TensorFlow could list no GPU, and importing it costs seconds.
            data["frameworks"]["tensorflow"] = known
            data["tensorflow_gpus"] = []
        else:
            tf_backend.import_quietly()  # once, its start-up banner kept off the terminal
            data["frameworks"]["tensorflow"] = tf_backend.version()
            data["tensorflow_gpus"] = tf_backend.device_overview()
    return data


def info(as_json: bool, tensorflow: bool = True) -> int:
    data = collect_info(tensorflow)
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"memguard {data['memguard']}, Python {data['python']} on {data['platform']}")
    for name, version in data["frameworks"].items():
        print(f"{name} {version}")
    if not tensorflow:
        print("tensorflow: skipped (--no-tensorflow)")
    print()
    rows = [("device", "name", "total", "used", "free")]
    rows += [(d["device"], str(d.get("name", "")), format_bytes(d.get("total")),
              format_bytes(d.get("used")), format_bytes(d.get("free"))) for d in data["devices"]]
    rows += [(f"TF {g['device']}", g["name"], "-", "-", "-")
             for g in data.get("tensorflow_gpus", [])]
    print(format_table(rows, left=2))
    print()
    if data["environment"]:
        print("allocator settings:")
        for name, value in data["environment"].items():
            print(f"  {name}={value}")
    else:
        print("allocator settings: none in the environment (the frameworks' defaults)")
    if data["nvml"]["driver"]:  # pragma: gpu
        print(f"NVIDIA driver {data['nvml']['driver']}")
        for gpu in data["nvml"]["gpus"]:
            for pid, used in gpu["processes"].items():
                print(f"  GPU {gpu['index']}: process {pid} uses {format_bytes(used)}")
    return 0


# -- watch -----------------------------------------------------------------------------------------
def watch(interval: float, count: Optional[int], pid: Optional[int]) -> int:
    import psutil

    from .backends import nvml

    process = None
    if pid is not None:
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            print(f"memguard watch: no process {pid}", file=sys.stderr)
            return 1
    taken = 0
    while count is None or taken < count:
        if taken:
            time.sleep(interval)
        parts = [time.strftime("%H:%M:%S")]
        vm = psutil.virtual_memory()
        if process is not None:
            try:
                parts.append(f"pid {pid} rss {format_bytes(process.memory_info().rss)}")
            except psutil.NoSuchProcess:
                print(f"memguard watch: process {pid} ended", file=sys.stderr)
                return 0
        parts.append(f"host used {format_bytes(vm.total - vm.available)} free "
                     f"{format_bytes(vm.available)}")
        for gpu in nvml.gpus(pid):  # pragma: gpu
            mine = sum(gpu["processes"].values())
            parts.append(f"GPU {gpu['index']} used {format_bytes(gpu['used'])} free "
                         f"{format_bytes(gpu['free'])}"
                         + (f" (pid {format_bytes(mine)})" if pid is not None else ""))
        print("  ".join(parts), flush=True)
        taken += 1
    return 0
