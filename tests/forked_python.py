"""A shell script run as written, its ``python -m module ...`` commands each run by ``tests.parallel.harness.run_module``
(forked from the session's server, where torch, Lightning and neva are already imported) instead of a fresh
interpreter importing them again: ~3 s of CPU a command on CI's VM, and a README block runs eight to ten of them.

``python`` on the script's ``PATH`` is a shim (the interpreter without its site packages, standard library only, a few
tens of milliseconds): it hands its arguments, environment and working directory to this process over a Unix socket,
which runs the module through ``run_module`` and hands back its stdout, stderr and exit status. Anything other than
``python -m`` goes to the real interpreter. For scripts whose test is about what the commands do, not about the
interpreter's start-up (as ``run_module``'s own rule)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHIM = """#!{python} -S
import json, os, socket, sys

args = sys.argv[1:]
if len(args) < 2 or args[0] != "-m":
    os.execv({python!r}, [{python!r}, *args])
request = {{"module": args[1], "argv": args[2:], "env": dict(os.environ), "cwd": os.getcwd()}}
with socket.socket(socket.AF_UNIX) as s:
    s.connect({socket!r})
    s.sendall(json.dumps(request).encode())
    s.shutdown(socket.SHUT_WR)
    reply = json.loads(b"".join(iter(lambda: s.recv(1 << 16), b"")))
sys.stdout.buffer.write(reply["out"].encode())
sys.stderr.buffer.write(reply["err"].encode())
sys.exit(reply["rc"])
"""


def _receive(conn: socket.socket) -> dict:
    return json.loads(b"".join(iter(lambda: conn.recv(1 << 16), b"")))


def run_script(script: str, cwd: Path, env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    """``bash -euc script`` in ``cwd`` with ``env`` (its ``python -m`` commands forked, as above), as
    ``subprocess.run(..., capture_output=True, text=True)`` returns it."""
    from tests.parallel.harness import run_module

    with tempfile.TemporaryDirectory(prefix="forked_python_") as tmp:
        tmp_path = Path(tmp)
        shim = tmp_path / "bin" / "python"
        shim.parent.mkdir()
        shim.write_text(SHIM.format(python=sys.executable, socket=str(tmp_path / "python.sock")))
        shim.chmod(0o755)
        env = {**env, "PATH": f"{shim.parent}{os.pathsep}{env.get('PATH', '')}"}
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(tmp_path / "python.sock"))
            server.listen()
            server.settimeout(0.2)  # how often the loop below looks whether the script has ended
            # The script's own output to files: a pipe nobody reads while a command runs could fill and block it.
            with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
                proc = subprocess.Popen(["bash", "-euc", script], cwd=cwd, env=env, stdout=out, stderr=err, text=True)
                deadline = time.monotonic() + timeout
                try:
                    while proc.poll() is None:
                        if time.monotonic() > deadline:
                            raise subprocess.TimeoutExpired(["bash", "-euc", script], timeout)
                        try:
                            conn, _ = server.accept()
                        except TimeoutError:
                            continue
                        with conn:
                            conn.settimeout(None)
                            request = _receive(conn)
                            # the command's PATH without the shim: a ``python`` it starts itself is a real one (this
                            # loop, busy with the command, could not answer it)
                            path = request["env"].get("PATH", "").split(os.pathsep)
                            request["env"]["PATH"] = os.pathsep.join(p for p in path if p != str(shim.parent))
                            done = run_module(
                                request["module"], request["argv"], env=request["env"], cwd=request["cwd"]
                            )
                            reply = {"out": done.stdout, "err": done.stderr, "rc": done.returncode}
                            conn.sendall(json.dumps(reply).encode())
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                out.seek(0)
                err.seek(0)
                return subprocess.CompletedProcess(["bash", "-euc", script], proc.returncode, out.read(), err.read())
