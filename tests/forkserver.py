"""A fork server for the ``pytest --kvconform`` runs the project's tests start (``run_kvconform``).

A run in a fresh ``python -m pytest`` spends ~4-5 CPU-s importing torch, transformers (and through
``transformers.cache_utils`` hqq, dynamo and inductor) before its first item; the tests start ~100 such runs. This
server imports those packages once, then forks a child per run: the child is still a process of its own (its own
pytest session, plugin and kvconform modules, exit code, stdout and stderr in files, killed on a timeout), it only
starts from a process that has imported the third-party packages. Nothing kvconform's plugin loads is imported here
(pytest would then not rewrite its asserts, and warn): the child imports pytest's plugins and kvconform itself.

What a fresh interpreter would set from its environment and a fork inherits is set again in the child: the folder,
the environment, ``sys.path`` (the folder, then ``PYTHONPATH``), ``sys.dont_write_bytecode`` and the seeds of
``random`` (kvconform draws its fuzz seed from it). ``KVCONFORM_TESTS_FORK=0`` runs every run in a fresh
interpreter instead, as before.

Protocol (one JSON line each way, over the server's stdin / stdout): the request ``{"args", "cwd", "env", "out",
"err"}``; the replies ``{"pid"}`` once the child is forked, then ``{"ret"}`` (its exit status; ``-N`` for signal N).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

PRELOAD = ("torch", "transformers", "transformers.cache_utils", "transformers.generation", "optimum.quanto",
           "hqq.core.quantize", "torch._dynamo", "torch._inductor.compile_fx")
"""Imported once by the server (each where installed): the bulk of a run's start-up."""

ENV = "KVCONFORM_TESTS_FORK"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and hasattr(os, "fork")


class ForkServer:
    """The client: one server process per test process, started at the first run."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)

    def run(self, args, cwd, env, out, err, timeout=None) -> int:
        """Run ``pytest *args`` in a child forked from the server. Returns its exit status.

        Raises:
            subprocess.TimeoutExpired: the child ran longer than ``timeout`` seconds (it is killed first).
            RuntimeError: the server ended (its exit status in the message).
        """
        request = {"args": [os.fspath(a) for a in args], "cwd": os.fspath(cwd), "env": dict(env),
                   "out": os.fspath(out), "err": os.fspath(err)}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._reply(None)["pid"]
        try:
            return self._reply(timeout)["ret"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._reply(None)  # the server reaps the child and replies
            raise

    def _reply(self, timeout) -> dict:
        if timeout is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("pytest (forked)", timeout)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server ended (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_SERVERS: list[ForkServer] = []  # this process's server, started at its first run


def server() -> ForkServer:
    """This process's fork server (started now if it is not running)."""
    if not _SERVERS or _SERVERS[0].proc.poll() is not None:
        _SERVERS[:] = [ForkServer()]
    return _SERVERS[0]


def close() -> None:
    for srv in _SERVERS:
        srv.close()
    _SERVERS.clear()


def run_pytest(args, cwd, env, timeout=None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, in a child of this process's fork server (a fresh interpreter when ``enabled()`` is False).

    Raises:
        subprocess.TimeoutExpired: as ``subprocess.run``.
    """
    import tempfile

    if not enabled():
        return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        ret = server().run(args, cwd, env, out, err, timeout=timeout)
        with open(out, encoding="utf8") as f1, open(err, encoding="utf8") as f2:
            return subprocess.CompletedProcess(["pytest", *args], ret, f1.read(), f2.read())


def _child(request) -> None:
    """In the forked child: become a fresh ``python -m pytest *args`` run and exit with its status."""
    code = 3
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(handle, fd)
            os.close(handle)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [request["cwd"], *extra, *sys.path[1:]]
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import pytest

        sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *request["args"]]
        code = int(pytest.main(request["args"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, like an interpreter would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit

        try:
            sys.stdout.flush()
            sys.stderr.flush()
            atexit._run_exitfuncs()
        finally:
            os._exit(code)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not installed here: the child imports what it needs
            pass
    requests = sys.stdin.buffer
    reply_fd = os.dup(1)
    sys.stdout.flush()
    sys.stderr.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(reply_fd)
            _child(request)
        os.write(reply_fd, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        ret = os.waitstatus_to_exitcode(status)
        os.write(reply_fd, (json.dumps({"ret": ret}) + "\n").encode())


if __name__ == "__main__":
    serve()
