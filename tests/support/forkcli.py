"""`python -m spillpack ...` for run_cli, forked from a process that has imported torch already.

Most of a CLI test is one process starting Python and importing torch (1.2-1.7 s of a tiny
`run`'s 2.7 s here). A server per xdist worker imports the third-party libraries once; each call
is a fork of it that runs `spillpack` as `python -m spillpack` would: its own pid, environment,
working directory, argv and stdio (files), a real exit code or signal, and the interpreter's own
exit (atexit, threads joined). Nothing of the runtime is imported before the fork, so every
module of spillpack, and everything it reads from the environment, is fresh in each call.

A call whose environment differs from the server's in a variable a library reads as it loads
(OpenMP's, oneDNN's, PYTHONPATH, ...), or that passes anything besides `cwd`, runs in a fresh
interpreter as before (`eligible`); so do the tests that start processes themselves (signals,
bundles, cgroups). SPILLPACK_TEST_FORK=0 turns the server off.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Read by a library as it loads (or by the interpreter as it starts): a call that sets one of
# these otherwise than the server runs in a fresh interpreter.
LOAD_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH_", "PYTORCH_",
                      "CUDA_", "LD_", "PYTHON", "MALLOC_", "GLIBC_", "LRU_CACHE_CAPACITY", "TOKENIZERS_", "NUMPY_")
# What every job imports before its first step (runtime.base.threads' settings are applied first,
# as spillpack/__main__.py applies them before torch loads).
PRELOAD = ("numpy", "torch", "torch.nn.functional", "safetensors.torch", "tokenizers", "orjson", "psutil", "jinja2", "gguf")

SERVER = r"""
import json, os, select, signal, socket, struct, sys
path, repo = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo)
from runtime.base.threads import quiet_openmp
quiet_openmp()
for name in [m for m in sys.modules if m == "runtime" or m.startswith("runtime.")]:
    del sys.modules[name]  # imported again, fresh, by each call
sys.path.remove(repo)
import importlib
for name in PRELOAD:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(16)
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
signal.signal(signal.SIGCHLD, lambda *a: None)
calls = {}  # pid -> connection
server = os.getpid()
child = None
while child is None:
    try:
        ready = select.select([listener, r], [], [])[0]
    except InterruptedError:
        ready = [r]
    if r in ready:
        os.read(r, 4096)
        while calls:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = calls.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                conn.sendall(struct.pack("!i", code))
                conn.close()
    if listener in ready:
        conn, _ = listener.accept()
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        if not data.endswith(b"\n"):
            conn.close()
            continue
        req = json.loads(data)
        pid = os.fork()
        if pid == 0:
            child = req
            listener.close()
            conn.close()
            for c in calls.values():
                c.close()
        else:
            calls[pid] = conn
            conn.sendall(struct.pack("!i", pid))
signal.set_wakeup_fd(-1)
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
os.close(r)
os.close(w)
for fd, name, flags in ((0, "/dev/null", os.O_RDONLY), (1, child["stdout"], os.O_WRONLY), (2, child["stderr"], os.O_WRONLY)):
    f = os.open(name, flags)
    os.dup2(f, fd)
    os.close(f)
os.environ.clear()
os.environ.update(child["env"])
os.chdir(child["cwd"])
sys.path[0] = child["cwd"]  # as `python -m` puts the working directory first
sys.argv = ["-m", *child["args"]]
import atexit, runpy, threading
code = 0
try:
    runpy.run_module("spillpack", run_name="__main__", alter_sys=True)
except SystemExit as e:
    if isinstance(e.code, int) or e.code is None:
        code = e.code or 0
    else:
        print(e.code, file=sys.stderr)
        code = 1
except KeyboardInterrupt:
    sys.excepthook(*sys.exc_info())
    code = -signal.SIGINT
except BaseException:
    sys.excepthook(*sys.exc_info())
    code = 1
# The interpreter's own exit but for tearing every module down (a second with torch loaded, where
# a fresh process that never imported it exits at once): threads joined, atexit, stdio flushed.
threading._shutdown()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except Exception:
        pass
if code == -signal.SIGINT:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
os._exit(code & 0xFF)
""".replace("PRELOAD", repr(PRELOAD))


def load_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}


class Server:
    def __init__(self, env: dict, repo: Path):
        # In /tmp itself: a socket's path has at most 107 bytes, and a test may point TMPDIR deep.
        self.dir = Path(tempfile.mkdtemp(prefix="spillpack-forkcli-", dir="/tmp"))
        self.path = str(self.dir / "sock")
        self.env = load_time_env(env)
        self.log = open(self.dir / "server.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, self.path, str(repo)], env=env, cwd="/",
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the fork server did not start: {(self.dir / 'server.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, args: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        fd, name = tempfile.mkstemp(dir=self.dir, prefix="call-")
        os.close(fd)
        out, err = Path(name + ".out"), Path(name + ".err")
        Path(name).unlink()
        out.write_bytes(b"")
        err.write_bytes(b"")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"args": list(map(str, args)), "env": env, "cwd": str(cwd),
                                 "stdout": str(out), "stderr": str(err)}).encode() + b"\n")
        pid = _int(conn, None)
        try:
            code = _int(conn, timeout)
        except socket.timeout:
            os.kill(pid, signal.SIGKILL)
            _int(conn, None)
            raise subprocess.TimeoutExpired([sys.executable, "-m", "spillpack", *args], timeout,
                                            output=out.read_text(errors="replace"), stderr=err.read_text(errors="replace"))
        finally:
            conn.close()
        result = subprocess.CompletedProcess([sys.executable, "-m", "spillpack", *args], code,
                                             out.read_text(errors="replace"), err.read_text(errors="replace"))
        out.unlink()
        err.unlink()
        return result

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()


def _int(conn, timeout) -> int:
    conn.settimeout(timeout)
    data = b""
    while len(data) < 4:
        chunk = conn.recv(4 - len(data))
        if not chunk:
            raise RuntimeError("the fork server closed the connection")
        data += chunk
    return struct.unpack("!i", data)[0]


_servers: dict = {}


def enabled() -> bool:
    return os.environ.get("SPILLPACK_TEST_FORK", "1") != "0"


def run(args, env: dict, cwd, timeout: float, repo: Path) -> subprocess.CompletedProcess | None:
    """The call's result through this worker's server, or None where it must run in a fresh
    interpreter (the module's doc)."""
    if not enabled():
        return None
    key = json.dumps(load_time_env(env), sort_keys=True)
    if key in _servers and _servers[key] is None:
        return None
    server = _servers.get(key)
    if server is None or not server.alive():
        if server is not None:  # it died: another takes its place
            server.close()
            del _servers[key]
        if len([s for s in _servers.values() if s is not None]) >= 3:  # an odd environment is a fresh interpreter, not one more server
            return None
        try:
            server = _servers[key] = Server(env, repo)
        except RuntimeError as e:  # the call still runs, in a fresh interpreter, and the reason is kept
            print(f"forkcli: {e}", file=sys.stderr)
            _servers[key] = None  # not tried again in this worker
            return None
    return server.run(args, env, cwd, timeout)


def close_all() -> None:
    for server in _servers.values():
        if server is not None:
            server.close()
    _servers.clear()
