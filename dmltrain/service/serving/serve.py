"""`dmltrain serve`: an index directory (local or logged to a run) as a search service over HTTP.

The service is MLflow's own scoring server (``mlflow models serve``) on the search pyfunc of the index and
its model (`search_model`), saved to a temporary folder for as long as it serves: ``POST /invocations``
with the images, ``GET /ping`` for health. Nothing here handles requests, so what MLflow documents for
its model servers (request formats, workers, timeouts) holds as it is.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from dmltrain.data.pools import available_cpus
from dmltrain.service.serving.indexing import check_built_with, index_directory
from dmltrain.service.serving.loading import located
from dmltrain.service.serving.pyfunc import save_pyfunc
from dmltrain.service.serving.search_model import index_files_only, search_parts
from dmltrain.service.serving.weights import load_weights, weights_digest


def save_search_model(
    index: str, out: str | Path, *, model: str | None = None, tracking_uri: str | None = None
) -> dict[str, Any]:
    """Write the search pyfunc of ``index`` (with the model it was built with, or ``model``) to ``out``;
    returns the index's metadata."""
    from dmltrain.index import load_index

    with index_directory(index, tracking_uri) as index_dir:
        if not index_dir.is_dir():
            raise FileNotFoundError(
                f"index not found: {index} (an index directory or runs:/<run_id>/indexes/<name>)"
            )
        meta = load_index(index_dir).meta
        with (
            located(model or meta["model"], tracking_uri) as (weights, _run_id),
            index_files_only(index_dir) as files,
        ):
            if model is None:  # the file's own step (None when it has none), as `dmltrain search` reads it
                step = load_weights(weights).get("step")
                check_built_with(meta, step, meta["model"], weights_digest(weights))
            save_pyfunc(out, search_parts(weights, files))
    return meta


def serve_command(model_dir: Path, host: str, port: int, workers: int) -> list[str]:
    """MLflow's scoring server on a saved model, in this Python environment (no new one is built)."""
    return [
        *(sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model_dir)),
        *("--env-manager", "local", "--host", host, "--port", str(port), "--workers", str(workers)),
    ]


def server_environment(workers: int = 1) -> dict[str, str]:
    """This environment with this Python's scripts first on PATH: MLflow starts the server as `uvicorn`
    through a shell, which a venv's dmltrain run by its full path (venv not activated) would not find.
    Without download bars (MLflow copies the local model folder it serves) unless the user asks, and with
    the CPUs shared out between the server processes (torch and faiss would each start a thread per CPU
    in every one of them) unless OMP_NUM_THREADS says otherwise."""
    env = dict(os.environ)
    env.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    env.setdefault("OMP_NUM_THREADS", str(max(1, available_cpus(limit=1 << 16) // workers)))
    scripts = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([scripts, env["PATH"]]) if env.get("PATH") else scripts
    return env


def address_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` (in use, not an address of this machine), or None.
    Found here, before the model is saved and loaded, it is one line; found by uvicorn, it was MLflow's
    traceback after the server had started."""
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        return f"--host {host}: not an address ({error.strerror})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind(address)
        except OSError as error:
            return f"--host {host} --port {port}: cannot listen there ({error.strerror or error})"
    return None


def _signal_group(server: subprocess.Popen[bytes], signum: int) -> bool:
    """Signal the server's process group; False when none of it is left."""
    try:
        os.killpg(server.pid, signum)
    except ProcessLookupError:
        return False
    return True


def _reap_orphans() -> None:
    """Reap exited children this process did not start: as a container's PID 1 (`dmltrain serve` as the
    pod's command) it inherits uvicorn when MLflow's process exits first, and an unreaped one would hold
    the group for the whole grace period."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_group(server: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """Wait until every process of the server's group is gone (uvicorn shuts down after MLflow's process
    has exited), so its model folder can go; SIGKILL what is still there after ``grace`` seconds."""
    if server.poll() is None:
        _signal_group(server, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _signal_group(server, 0) and time.monotonic() < deadline:
        server.poll()  # reaps MLflow's process: a zombie still counts as a member of the group
        _reap_orphans()
        time.sleep(0.1)
    if _signal_group(server, signal.SIGKILL):
        server.wait()


def serve_index(
    index: str,
    *,
    model: str | None = None,
    host: str = "127.0.0.1",
    port: int = 5000,
    workers: int = 1,
    tracking_uri: str | None = None,
) -> int:
    """Serve ``index`` until interrupted (Ctrl-C or SIGTERM, passed on to the server's processes); the
    saved model is removed when the server stops. Returns the server's exit status (0 when stopped by a
    signal)."""
    problem = address_problem(host, port)
    if problem:
        raise ValueError(problem)
    servers: list[subprocess.Popen[bytes]] = []
    stopped: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopped.append(signum)
        if not servers:  # still copying the model: unwind, so the temporary folder is removed
            raise _StopRequested
        _signal_group(servers[0], signal.SIGTERM)

    # From the start: a SIGTERM while the model is copied (seconds) killed the process outright and left
    # the copy (45 MB for a small model) in /tmp.
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with tempfile.TemporaryDirectory(prefix="dmltrain-serve-") as tmp:
            model_dir = Path(tmp) / "search_model"
            meta = save_search_model(index, model_dir, model=model, tracking_uri=tracking_uri)
            print(
                f"serving {index}: {meta['ntotal']} images of {meta['dataset']}/{meta['split']} "
                f"({meta['description']}), model {model or meta['model']}\n"
                f"POST http://{host}:{port}/invocations "
                '{"dataframe_split": {"columns": ["image"], "data": [[<base64 image>]]}, '
                '"params": {"k": 10}}',
                flush=True,
            )
            # Its own process group: MLflow's command runs uvicorn as a child of its own, which a signal
            # to MLflow's process alone would leave serving.
            command, env = serve_command(model_dir, host, port, workers), server_environment(workers)
            servers.append(subprocess.Popen(command, env=env, start_new_session=True))
            server = servers[0]
            try:
                code = server.wait()
            except KeyboardInterrupt:
                stopped.append(signal.SIGINT)
                _signal_group(server, signal.SIGTERM)
                code = server.wait()
            finally:
                _end_group(server)
            return 0 if stopped else code
    except _StopRequested:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


class _StopRequested(BaseException):
    """SIGTERM before the server started: `serve_index` returns, its temporary model copy removed. A
    BaseException, as KeyboardInterrupt is: the loading code's own ``except Exception`` (a weights file
    it cannot read) turned it into a false "not a readable model file"."""
