"""Start or join Ray without opening this machine to the network.

Ray 2.60 turns a node IP of 127.0.0.1 into the machine's address and then listens on every interface
(GCS, raylet, workers, agents), whatever `_node_ip_address` or `--node-ip-address` says. It keeps
the loopback address only when it believes it runs a single-machine cluster, which its
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` setting says on any platform. So:

  - a local Ray (the in-process one of `evo run`, `evo serve` and the tests) gets that setting and
    127.0.0.1: every Ray process listens on loopback only; Ray's token authentication stays on
    (Ray's default for a new local Ray: it uses $RAY_AUTH_TOKEN, or ~/.ray/auth_token, which Ray
    creates; we keep that file readable by its owner only);
  - joining a cluster ($RAY_ADDRESS or `ray.address`) uses the cluster's token when one is on this
    machine (~/.ray/auth_token, $RAY_AUTH_TOKEN_PATH, $RAY_AUTH_TOKEN), as the CLI needs it.

Ray reads the setting when it is imported: `prepare_local()` sets it for this process (also after
the import) and for the Ray processes it starts.
"""
from __future__ import annotations

import importlib
import ipaddress
import os
import sys
import threading
from pathlib import Path
from typing import Any

LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
LOCALHOST = "127.0.0.1"


def prepare_local() -> None:
    """Make the next local Ray this process starts listen on 127.0.0.1 only, with token authentication.

    The token is Ray's default for a new local Ray; asked for explicitly (unless $RAY_AUTH_MODE says
    otherwise), Ray does not print its notice that it turned it on."""
    os.environ.update(LOOPBACK_ONLY)
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        if "ray" in sys.modules:  # Ray read its settings at import: have it read this one again, as Ray itself does
            from ray._private.authentication.authentication_token_setup import _enable_token_auth

            _enable_token_auth()
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray already imported: it read the setting at import time
        constants.ENABLE_RAY_CLUSTER = False


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and IPv4-mapped loopback (::ffff:127.0.0.1)."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host == "localhost"
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def init_local(**kwargs: Any) -> None:
    """A new in-process local Ray on 127.0.0.1 (even if `ray start` ran on this machine: address="local")."""
    prepare_local()
    import ray

    ray.init(address="local", _node_ip_address=LOCALHOST, **kwargs)
    node_ip = ray.util.get_node_ip_address()
    _owner_only(Path.home() / ".ray" / "auth_token")
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"the local Ray came up on {node_ip}, not on loopback: refusing to run with it open "
                           f"to the network ({LOOPBACK_ONLY} was not honoured by this Ray version)")


def join(address: str, **kwargs: Any) -> None:
    """Join the cluster at `address`, sending its token when this machine holds one."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)  # no-op when RAY_AUTH_MODE is set
    import ray

    ray.init(address=address, **kwargs)


def _owner_only(path: Path) -> None:
    """Ray writes the token file with the umask's permissions; the token is a password."""
    try:
        if path.exists() and path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except OSError:
        pass


def start_for_run(address: str | None, num_cpus: int | None) -> bool:
    """Ray for a run: join `address` (else $RAY_ADDRESS) when one is given, else a new local Ray on 127.0.0.1
    with `num_cpus` (else every core). Returns whether this process started or joined it (and so must stop
    it); False when it already had one."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    # Workers must import this project: it is pip-installed, and the env keeps the compile cache shared.
    env = {"env_vars": {k: os.environ[k] for k in ("TORCHINDUCTOR_CACHE_DIR",) if k in os.environ}}
    if address:
        join(address, runtime_env=env, log_to_driver=False)
        return True
    # a new Ray even if `ray start` ran on this machine, listening on 127.0.0.1 only
    init_local(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, runtime_env=env, log_to_driver=False)
    return True


def start_while_importing(module: str, address: str | None, num_cpus: int | None) -> bool:
    """`start_for_run` while a thread imports `module`: Ray's processes come up while this process loads
    torch and MLflow (on 2 cores ~5 s of imports beside ~4 s of Ray's start, ~2.5 s less than one after the
    other). Both are done on return; an import that failed fails again where the caller imports `module`."""
    import ray  # noqa: F401 - whole, before the thread imports the modules that use it

    loading = threading.Thread(target=_import_quietly, args=(module,), name=f"import {module}", daemon=True)
    loading.start()
    try:
        return start_for_run(address, num_cpus)
    finally:
        loading.join()


def _import_quietly(module: str) -> None:
    try:
        importlib.import_module(module)
    except BaseException:  # noqa: BLE001 - the caller's own import meets it again, with its traceback
        pass
