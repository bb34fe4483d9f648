"""The listening sockets of the processes a test started, and which of them the network can use.

A listener is fine when it is on a loopback address, or when it refuses a request that carries no
token (HTTP 401/403: Ray's token authentication). Anything else is exposed."""
import http.client
import os
import urllib.error
import urllib.request

import grpc
import psutil

from evo.driver.local_ray import is_loopback


RAY_SETTINGS = ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")  # what conftest sets


def user_shell(env: dict[str, str]) -> dict[str, str]:
    """`env` as a user's shell has it: none of the Ray settings conftest gives the test session (which keep its
    Ray private), only the token (so no test writes ~/.ray/auth_token; without one Ray creates that file). What
    keeps a process started with it private is the project's code."""
    return {k: v for k, v in env.items() if k not in RAY_SETTINGS}


def process_tree(root_pid: int) -> list[psutil.Process]:
    """`root_pid`, its descendants, and every process of its session when it leads one (a process the
    test started with start_new_session: Ray's workers take process groups of their own)."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_pid)
        found[root.pid] = root
        found.update({p.pid: p for p in root.children(recursive=True)})
        session = os.getsid(root_pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return list(found.values())
    if session == root_pid:
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == session:
                    found[process.pid] = process
            except (ProcessLookupError, psutil.Error):
                continue
    return list(found.values())


def listening(processes: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP listener of `processes`."""
    found = set()
    for process in processes:
        try:
            for c in process.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((process.pid, process.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:  # exited meanwhile
            continue
    return sorted(found)


def refuses_without_token(host: str, port: int) -> bool:
    """True when the server rejects a request without a token: HTTP 401/403, or gRPC UNAUTHENTICATED
    for a method it serves (Ray's interceptor checks the token once the method is known)."""
    url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
    try:
        with urllib.request.urlopen(url, timeout=5):
            return False
    except urllib.error.HTTPError as error:
        return error.code in (401, 403)
    except (OSError, ValueError, http.client.HTTPException):  # not HTTP/1: try gRPC
        pass
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        for method in GRPC_METHODS:
            try:
                channel.unary_unary(method)(b"", timeout=5)
                return False  # answered without a token
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return True
    return False  # cannot tell: it counts as exposed


# A method of each Ray gRPC service that may listen beyond loopback: Serve's replica-to-replica server
# binds [::] whatever the node IP (ray/serve/_private/replica.py), behind Ray's token interceptor.
GRPC_METHODS = ("/ray.serve.ASGIService/HandleRequest", "/ray.rpc.NodeInfoGcsService/GetClusterId",
                "/ray.rpc.NodeManagerService/GetNodeStats", "/ray.rpc.CoreWorkerService/NumPendingTasks")


def exposed(processes: list[psutil.Process]) -> list[tuple[int, str, str, int]]:
    """Listeners that are neither loopback-only nor behind a token."""
    out = []
    for pid, name, host, port in listening(processes):
        if is_loopback(host):
            continue
        probe = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        if not refuses_without_token(probe, port):
            out.append((pid, name, host, port))
    return out
