"""``python -m <script> ...`` for the tests, without paying the interpreter's imports on every call.

Most multi-rank tests run one of ``tests/scripts`` with ``--launch fork``: a
launching process that imports Lightning, then forks its ranks. On a 2-core host
``import lightning`` alone takes 4-7 s (it imports torchmetrics, which imports
torchvision and torch's compiler stack), most of such a fit's time. :func:`run`
starts the script instead in a process forked from a multiprocessing
*forkserver* that imported Lightning and this package once for the session: the
same code path as ``python -m`` (``runpy``, ``__name__ == "__main__"``,
``sys.argv``, the given environment and working directory, stdin from
``/dev/null``, stdout and stderr captured, the exit status as ``subprocess``
reports it, ``subprocess.TimeoutExpired`` after ``timeout``) in a fresh process
of its own, which forks its ranks as before.

The child also gets what a new interpreter's main process has: the variables the
preloaded imports set (beside the given environment), the working directory first
on ``sys.path``, the platform's default start method, ``PYTHONWARNINGS`` behind the
imports' own filters, and the ``atexit`` functions at its end. One difference
stays: ``run`` returns when the launching process exits, not when the last
process holding its stdout closes it (the ranks, which Lightning's launcher joins
before it returns).

Falls back to a real ``subprocess.run`` (the interpreter started afresh) for
what a preloaded process would change: a command that is not ``python -m
<module>``, ``--launch popen`` (the script launcher re-runs the command line for
every other rank: the tests of what torchrun and SLURM users run), ``--spy``
(the default-group spy must patch ``torch.distributed`` before Lightning is
imported), and an environment that changes a variable read at start-up only
(:data:`STARTUP_ONLY`). ``LP_TESTS_FORKSERVER=0`` turns it off for every call.

A test that starts each rank itself, as torchrun would (the rank's variables in
the environment, so that Lightning launches nothing), may build :class:`Forked`
directly: one process per rank still, each a sibling of the others.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional, Sequence

#: Imported once by the server: what every script run through it imports first. This module comes first, so
#: that it notes the environment before the others add to it (:data:`_SERVER_START_ENV`).
PRELOAD = ["tests.forkrun", "torch", "torch.distributed", "lightning.pytorch", "lightning_partial",
           "tests.scripts.launch"]

#: Read by an interpreter (or by the preloaded imports) at start-up only: a command whose environment gives one of
#: them another value than this process's (and so the server's) runs in a new interpreter instead.
STARTUP_ONLY = ("PYTHONHASHSEED", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONOPTIMIZE", "PYTHONDEVMODE",
                "OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: The environment this module was imported with: in the server, before the preloaded imports set variables of
#: their own (Lightning's ``PYTORCH_NVML_BASED_CUDA_CHECK``, ...), which a fresh interpreter would set too.
_SERVER_START_ENV = frozenset(os.environ)

_lock = threading.Lock()
_context: Optional[multiprocessing.context.BaseContext] = None


def server_on() -> bool:
    """Whether the preloaded server is in use at all (``LP_TESTS_FORKSERVER=0`` turns it off)."""
    return os.environ.get("LP_TESTS_FORKSERVER", "1") != "0"


def enabled(command: Sequence[str], env: Optional[dict[str, str]] = None) -> bool:
    """Whether ``command`` may run in a forked process (see the module docstring)."""
    args = list(command)
    given = os.environ if env is None else env
    return (server_on() and len(args) >= 3 and args[0] == sys.executable
            and args[1] == "-m" and "--spy" not in args and _launch(args) == "fork"
            and all(given.get(name) == os.environ.get(name) for name in STARTUP_ONLY))


def _launch(args: list[str]) -> str:
    """The script's ``--launch`` as argparse reads it (the last one given)."""
    launch = "popen"  # the scripts' default
    for i, arg in enumerate(args):
        if arg == "--launch" and i + 1 < len(args):
            launch = args[i + 1]
        elif arg.startswith("--launch="):
            launch = arg.split("=", 1)[1]
    return launch


def _server() -> multiprocessing.context.BaseContext:
    global _context
    with _lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            _context = context
        return _context


def _main(module: str, argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """The child: stdio redirected, the caller's environment and directory, then the module as ``__main__``,
    then the interpreter's exit functions (``atexit``), which the multiprocessing child would otherwise skip."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for path, fds in ([(stdout, (1, 2))] if stdout == stderr else [(stdout, (1,)), (stderr, (2,))]):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # one file: one offset for both
        for fd in fds:
            os.dup2(handle, fd)
        os.close(handle)
    added = {k: v for k, v in os.environ.items() if k not in _SERVER_START_ENV}  # by the preloaded imports
    os.environ.clear()
    os.environ.update(env)
    for key, value in added.items():
        os.environ.setdefault(key, value)
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # as `python -m` puts the working directory first
    # What a new interpreter's main process has: its own default start method (the platform's, not the
    # server's), its name, and PYTHONWARNINGS behind the filters its imports install.
    multiprocessing.set_start_method(None, force=True)
    multiprocessing.current_process().name = "MainProcess"
    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        if ":" in option:
            warnings._processoptions([option])  # type: ignore[attr-defined]
        else:
            warnings.filterwarnings(option, append=True)  # type: ignore[call-overload]
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class Forked:
    """A script running in a forked process, with what the tests use of ``subprocess.Popen``'s interface
    (``pid``, ``returncode``, ``poll``, ``wait``, ``communicate``, ``kill``, ``send_signal``); stdout and
    stderr go to files (both to ``log`` where given, as ``stderr=subprocess.STDOUT`` into a file would).

    Built directly (not through :func:`start`), it runs any ``python -m <module>`` command, whatever its
    ``--launch``: the tests that start each rank by hand, as torchrun would, set the rank's variables in ``env``.
    """

    def __init__(self, command: Sequence[str], env: Optional[dict[str, str]],
                 cwd: Optional[os.PathLike[str] | str], *, log: Optional[Path] = None) -> None:
        self.args = list(command)
        self._folder = tempfile.TemporaryDirectory(prefix="forkrun")
        if log is not None:
            self._stdout = self._stderr = Path(log)
        else:
            self._stdout, self._stderr = Path(self._folder.name) / "stdout", Path(self._folder.name) / "stderr"
        self._process = _server().Process(  # type: ignore[attr-defined]
            target=_main, name=f"forkrun {self.args[2]}",
            args=(self.args[2], self.args[3:], dict(os.environ if env is None else env), str(cwd or os.getcwd()),
                  str(self._stdout), str(self._stderr)),
        )
        self._process.start()
        self.pid: int = self._process.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, str]:
        """Waits for the end (``subprocess.TimeoutExpired`` after ``timeout``, the process left running), then
        its output."""
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        """What the process wrote to stdout and stderr so far."""
        return _read(self._stdout), _read(self._stderr)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # ended, and reaped by the server, since the poll: as Popen.send_signal
                pass

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()
        self._process.join()
        self.poll()

    def close(self) -> None:
        self._folder.cleanup()


def start(command: Sequence[str], *, env: Optional[dict[str, str]] = None,
          cwd: Optional[os.PathLike[str] | str] = None) -> "Forked | subprocess.Popen[str]":
    """``subprocess.Popen(command, env=env, cwd=cwd, stdout=DEVNULL, stderr=PIPE, text=True)``, or the same
    script forked from the preloaded server where :func:`enabled` allows (stdout then goes to a file)."""
    if not enabled(command, env):
        return subprocess.Popen(list(command), env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return Forked(command, env, cwd)


def run(command: Sequence[str], *, env: Optional[dict[str, str]] = None, timeout: Optional[float] = None,
        cwd: Optional[os.PathLike[str] | str] = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    stdin=subprocess.DEVNULL)``, in a process forked from the preloaded server where :func:`enabled` allows."""
    if not enabled(command, env):
        return subprocess.run(list(command), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    process = Forked(command, env, cwd)
    try:
        try:
            returncode = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.output()
            # pytest shows an exception's message, not its output: the tail goes to the test's captured stderr.
            sys.stderr.write(f"did not end within {timeout}s: {' '.join(process.args)}\n{err[-8000:]}\n")
            raise subprocess.TimeoutExpired(process.args, timeout or 0.0, out, err) from None
        except BaseException:  # pytest-timeout's signal, Ctrl-C: as subprocess.run, never leave the child running
            process.kill()
            raise
        return subprocess.CompletedProcess(process.args, returncode, *process.output())
    finally:
        process.close()
