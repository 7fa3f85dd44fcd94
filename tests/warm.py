"""Fresh interpreters that start with their frameworks imported: forking servers per test
process.

A snippet that imports torch before it names memguard pays 1-3 s in a new interpreter for
that import alone, and 0.3-0.5 s more to tear its modules down; TensorFlow and Lightning take
6-7 s each. Here a server imports the snippet's frameworks once and forks a child per snippet;
the child takes the snippet's environment, working folder and standard streams and runs it as
``python -c`` would, in a new ``__main__``, then leaves as the interpreter would less the
teardown. What the child shares with the server is only what a snippet cannot tell apart
(:func:`preloads`): its frameworks imported, in its order, and nothing run with them, and
the variables read when an interpreter or a framework starts (a server per set of them).
Any other snippet runs in a new interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional, Union

# read once by glibc, the interpreter, OpenMP/MKL, torch or coverage as a process starts
STARTUP = re.compile(r"^(MALLOC_|GLIBC_|LD_|PYTHON|OMP_|KMP_|MKL_|OPENBLAS_|GOTO|TORCH|PYTORCH"
                     r"|CUDA|COV|TF_)")
# what a server may import for a snippet's first lines; past torch, each reads variables of
# its own as it starts (a server per environment, PYTEST_CURRENT_TEST aside)
FRAMEWORKS = ("torch", "tensorflow", "keras", "transformers", "lightning", "pytorch_lightning")

SERVER = r"""
import importlib, json, os, select, signal, socket, sys
for module in sys.argv[1:]:  # the imports every child would pay
    importlib.import_module(module)

control = socket.socket(fileno=os.dup(0))
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_r, False)
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *args: None)
running = {}

def send(message):
    control.sendall(json.dumps(message).encode())

def serve():
    while True:
        ready = select.select([control, wake_r], [], [])[0]
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            send({"id": running.pop(pid), "status": os.waitstatus_to_exitcode(status)})
        if control in ready:
            # small reads only: a large buffer freed here would raise glibc's mmap threshold
            # in every child (a 4 MiB block then comes from the heap, unlike in a new process)
            data, fds, _, _ = socket.recv_fds(control, 4096, 3)
            if not data:
                sys.exit(0)  # the test process is gone
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return request, fds
            for fd in fds:
                os.close(fd)
            running[pid] = request["id"]
            send({"id": request["id"], "pid": pid})

request, fds = serve()
# the child: what `python -c` would have been
signal.set_wakeup_fd(-1)
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
control.close()
for fd in (wake_r, wake_w):
    os.close(fd)
with os.fdopen(fds[2]) as file:  # the snippet, its environment and folder
    request.update(json.load(file))
os.dup2(fds[0], 1)
os.dup2(fds[1], 2)
for fd in (*fds[:2], null):
    os.close(fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
import random
random.seed()
try:
    import numpy
    numpy.random.seed()
except ImportError:
    pass
sys.argv = ["-c"]
main = type(sys)("__main__")
sys.modules["__main__"] = main
# then leave as the interpreter would, less its module teardown: the uncaught exception
# printed, non-daemon threads joined, atexit run, streams flushed
code = 0
try:
    exec(compile(request["code"], "<string>", "exec"), main.__dict__)
except SystemExit as stop:
    if stop.code is None or isinstance(stop.code, int):
        code = stop.code or 0
    else:
        print(stop.code, file=sys.stderr)
        code = 1
except BaseException:
    sys.excepthook(*sys.exc_info())
    code = -2 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1
import atexit, threading
threading._shutdown()
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
if code == -2:  # as Python ends on an uncaught KeyboardInterrupt: by SIGINT
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
os._exit(code & 0xFF)
"""


def eligible(code: str) -> bool:
    """Whether ``code`` imports torch before it names memguard (which reads, at import,
    whether torch came first)."""
    at = code.find("import torch")
    named = code.find("memguard")
    return at >= 0 and (named < 0 or at < named)


IMPORT = re.compile(r"(?:import\s+(?P<names>[\w., ]+?)(?:\s+as\s+\w+)?|from\s+(?P<package>[\w.]+)"
                    r"\s+import\s+.+)\s*(?:#.*)?")


def preloads(code: str) -> tuple[str, ...]:
    r"""The frameworks a server imports before it forks ``code``, in ``code``'s order: those of
    its first lines while they are only imports and name no memguard (nothing else has run
    when a snippet imports them, so none can tell); else torch where :func:`eligible`; else
    none.

    >>> preloads("import json\nimport tensorflow as tf\nimport memguard\nimport torch")
    ('tensorflow',)
    >>> preloads("import os\nos.environ['TF_X'] = '1'\nimport tensorflow")
    ()
    """
    found: list[str] = []
    for line in code.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = IMPORT.fullmatch(line)
        if match is None or "memguard" in line:
            break
        names = match["names"].split(",") if match["names"] else [match["package"]]
        for name in names:
            top = name.split(" as ")[0].strip().split(".")[0]
            if top in FRAMEWORKS and top not in found:
                found.append(top)
    if found:
        return tuple(found)
    return ("torch",) if eligible(code) else ()


class Process:
    """A child of a :class:`Server`, with the parts of :class:`subprocess.Popen` the tests
    use (text streams)."""

    def __init__(self, code: str, stdout: Optional[int], stderr: Optional[int]) -> None:
        self.args = [sys.executable, "-c", code]
        self.stdout = os.fdopen(stdout, "r") if stdout is not None else None
        self.stderr = os.fdopen(stderr, "r") if stderr is not None else None
        self.pid: Optional[int] = None
        self.returncode: Optional[int] = None
        self.started = threading.Event()
        self.ended = threading.Event()

    def poll(self) -> Optional[int]:
        return self.returncode if self.ended.is_set() else None

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.started.wait(60) and not self.ended.is_set() and self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        texts = {}

        def drain(name: str, stream: Any) -> None:
            texts[name] = stream.read() if stream is not None else None

        readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr))]
        for reader in readers:
            reader.start()
        self.wait(timeout)
        for reader in readers:  # the streams end with the child (or with what it started)
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return texts["out"], texts["err"]


class Server:
    """One forking server, started with ``env``; it runs any number of children at once."""

    def __init__(self, env: dict[str, str], modules: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *modules], stdin=theirs,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env)
        theirs.close()
        self.control = ours
        self.lock = threading.Lock()
        self.children: dict[int, Process] = {}
        self.count = 0
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                data = self.control.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the server ended: so did its children, as far as anyone waits
                with self.lock:
                    for child in self.children.values():
                        child.returncode = -signal.SIGKILL
                        child.started.set()
                        child.ended.set()
                    self.children.clear()
                return
            message = json.loads(data)
            with self.lock:
                child = self.children.get(message["id"])
                if child is None:
                    continue
                if "pid" in message:
                    child.pid = message["pid"]
                    child.started.set()
                else:
                    del self.children[message["id"]]
                    child.returncode = message["status"]
                    child.ended.set()

    def start(self, code: str, env: dict[str, str], stdout: bool, stderr: bool,
              cwd: Optional[str] = None) -> Process:
        """``code`` forked with ``env`` in ``cwd`` (default: this process's folder); its
        streams are pipes where asked, else /dev/null."""
        ends = []
        for wanted in (stdout, stderr):
            if wanted:
                ends.append(os.pipe())
            else:
                null = os.open(os.devnull, os.O_WRONLY)
                ends.append((None, null))
        child = Process(code, ends[0][0], ends[1][0])
        with self.lock:
            self.count += 1
            ident = self.count
            self.children[ident] = child
        with tempfile.TemporaryFile("w+") as file:
            json.dump({"code": code, "env": env, "cwd": cwd or os.getcwd()}, file)
            file.flush()
            file.seek(0)
            try:
                socket.send_fds(self.control, [json.dumps({"id": ident}).encode()],
                                [end[1] for end in ends] + [file.fileno()])
            finally:
                for end in ends:
                    os.close(end[1])
        if not child.started.wait(60):
            raise RuntimeError("the forking server did not start the snippet")
        return child

    def close(self) -> None:
        self.control.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_servers: dict[tuple, Server] = {}
_guard = threading.Lock()
_owner = os.getpid()  # a process forked from a test process starts its own interpreters


def popen(code: str, env: dict[str, str], stdout: bool = True, stderr: bool = True,
          cwd: Optional[str] = None) -> Union[Process, subprocess.Popen]:
    """``code`` started as ``python -c`` with ``env`` in ``cwd`` would be (text streams: pipes
    where asked, else /dev/null), forked from a server where it has :func:`preloads`."""
    modules = preloads(code)
    if modules and os.getpid() == _owner:
        read = STARTUP.match if modules == ("torch",) else (
            lambda name: name != "PYTEST_CURRENT_TEST")
        key = (modules, *sorted((k, v) for k, v in env.items() if read(k)))
        with _guard:
            server = _servers.pop(key, None)  # put back last: the least used goes first
            if server is None or server.proc.poll() is not None:
                if len(_servers) >= 6:
                    _servers.pop(next(iter(_servers))).close()
                server = Server(env, modules)
            _servers[key] = server
        return server.start(code, env, stdout, stderr, cwd)
    pipe = subprocess.PIPE
    return subprocess.Popen([sys.executable, "-c", code], text=True, env=env, cwd=cwd,
                            stdout=pipe if stdout else subprocess.DEVNULL,
                            stderr=pipe if stderr else subprocess.DEVNULL)


def run(code: str, env: dict[str, str], timeout: float,
        cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """``code`` run to its end as ``python -c`` with ``env`` in ``cwd`` would run it; past
    ``timeout`` seconds it is killed and :class:`subprocess.TimeoutExpired` raised."""
    proc = popen(code, env, cwd=cwd)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.wait(), stdout, stderr)


@atexit.register
def close_all() -> None:
    """End every server of this process."""
    while _servers:
        _servers.popitem()[1].close()
