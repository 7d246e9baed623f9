"""`make lab`: JupyterLab on the notebooks with the `rla` kernel, on a free local port, its URL printed once.

    python -m tools.lab [--port 8888] [notebook_dir] [-- extra jupyter lab arguments]

The server listens on 127.0.0.1 only. If the port is taken the next free one is used (and said so). The
URL carries a token made here, so it can be printed plainly once the server answers, instead of being
lost in Jupyter's log. The browser test (tests/test_browser.py) starts its server through `start` too.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from rla_lib.paths import ROOT

KERNEL = "rla"
HOST = "127.0.0.1"
DEFAULT_PORT = 8888


class KernelMissing(RuntimeError):
    pass


def kernel_installed(name: str = KERNEL) -> bool:
    """Whether Jupyter (of this Python's environment) has the kernel `make setup` registers."""
    from jupyter_client.kernelspec import KernelSpecManager

    return name in KernelSpecManager().find_kernel_specs()


def require_kernel(name: str = KERNEL) -> None:
    if not kernel_installed(name):
        raise KernelMissing(f"the Jupyter kernel '{name}' is not installed in {sys.prefix}: run `make setup` first "
                            "(it creates .venv and registers the kernel)")


def port_is_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(start: int = DEFAULT_PORT, host: str = HOST, tries: int = 100) -> int:
    """The first port from `start` on that `host` can bind."""
    for port in range(start, start + tries):
        if port_is_free(port, host):
            return port
    raise RuntimeError(f"no free port in {start}..{start + tries - 1} on {host}")


def lab_url(port: int, token: str, path: str = "lab") -> str:
    return f"http://{HOST}:{port}/{path}?token={token}"


def lab_command(port: int, token: str, notebook_dir: Path, extra=(), log_level: str = "WARN") -> list[str]:
    """`jupyter lab` on 127.0.0.1:port, quiet log, `rla` the default kernel, no update checks (no network)."""
    return [sys.executable, "-m", "jupyterlab", str(notebook_dir),
            f"--ServerApp.ip={HOST}", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--log-level={log_level}",
            f"--MappingKernelManager.default_kernel_name={KERNEL}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            *(["--allow-root"] if os.geteuid() == 0 else []), *extra]  # containers and CI run as root


def start(notebook_dir: Path, port: int, token: str, extra=(), env=None, log_level="WARN",
          **popen_kwargs) -> subprocess.Popen:
    """Start the server (after checking the kernel); `wait_until_ready` before using it."""
    require_kernel()
    return subprocess.Popen(lab_command(port, token, notebook_dir, extra, log_level), env=env, **popen_kwargs)


def wait_until_ready(proc: subprocess.Popen, port: int, token: str, timeout: float = 600) -> None:
    """Poll the server's status API until it answers; raise at once if the process exits, or after `timeout` (a hang
    guard: a start beside other work on a loaded 2-core machine has taken over 120 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {proc.returncode} before answering on port {port}")
        try:
            with urllib.request.urlopen(lab_url(port, token, "api/status"), timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise TimeoutError(f"JupyterLab did not answer on port {port} within {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook_dir", nargs="?", default=str(ROOT / "notebooks"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("LAB_PORT", DEFAULT_PORT)),
                        help="preferred port (default $LAB_PORT or 8888); the next free one if taken")
    args, extra = parser.parse_known_args(argv)
    try:
        require_kernel()
    except KernelMissing as e:
        print(f"make lab: {e}", file=sys.stderr)
        return 1
    port = free_port(args.port)
    if port != args.port:
        print(f"port {args.port} is taken; using {port}")
    token = secrets.token_hex(16)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the server too when this script is told to stop
        signal.signal(sig, lambda *_: sys.exit(0))
    # own session: Ctrl-C reaches only this script, which stops the server (Jupyter would ask "Shutdown?")
    proc = start(Path(args.notebook_dir), port, token, [a for a in extra if a != "--"], start_new_session=True)
    try:
        wait_until_ready(proc, port, token)
        print(f"\n  JupyterLab ({args.notebook_dir}, kernel '{KERNEL}') is running. Open:\n\n    {lab_url(port, token)}\n\n"
              f"  Stop with Ctrl-C.\n", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"make lab: {e} (its log is above)", file=sys.stderr)
        return 1
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
