"""A process that has imported torch and the runtime once and forks the test ranks from there (``spawn_ranks``).

Every rank the runtime tests start would otherwise spend about 3.5 s of CPU importing torch, the runtime and
transformers; on the 2 cores CI has, a 4-rank launch spent 7 s of its wall time on imports alone. This server
imports them once per test session and forks one child per rank. A child is what ``python ARGV`` would be: its
own environment, working folder, ``sys.argv``, standard streams on the files it is given, ``__main__`` run by
``runpy``, atexit handlers at exit, its exit status that of the script.

What a fork shares that fresh interpreters would not: the hash seed of ``str``. Two servers with different seeds
run side by side and rank ``r`` is forked from server ``r % 2``, so ranks that iterate a set of names in different
orders still disagree here as they would under torchrun. The server starts no thread (checked at start), so a
fork is safe; it exits when its standard input closes (the test session ended).

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout.
    {"spawn": {"argv": [...], "env": {...}, "cwd": "...", "stdout": "path", "stderr": "path"}} -> {"pid": 123}
    {"poll": 123} -> {"code": null | int}      (non-blocking; reaps the child once it has ended)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "runtime.executor.train",
    "runtime.models",
    "transformers",
)


def _child(req: dict) -> None:
    """Become ``python argv`` (never returns)."""
    import atexit
    import runpy

    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = list(req["argv"])
        try:
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                sys.path[0] = req["cwd"]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = argv
                sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - print it as the interpreter would, then exit 1
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream must not change the exit status
                pass
        os._exit(code)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # transformers is an extra; the ranks that need it import it themselves
            pass
    if threading.active_count() != 1:
        raise SystemExit(f"rank_zygote: {threading.active_count()} threads after the imports; forking is unsafe")
    proto_in, proto_out = sys.stdin, sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=proto_out, flush=True)
    for line in proto_in:
        req = json.loads(line)
        if "spawn" in req:
            proto_out.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req["spawn"])
            reply = {"pid": pid}
        else:
            pid = req["poll"]
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                reply = {"code": None, "error": f"no child {pid}"}
            else:
                reply = {"code": os.waitstatus_to_exitcode(status) if done else None}
        print(json.dumps(reply), file=proto_out, flush=True)


if __name__ == "__main__":
    serve()
