"""A real Apache Pulsar standalone broker for tests, benchmarks and `make apache-pulsar`.

The broker and its dependencies are resolved from Maven Central by the small Maven project in
`tools/apache-pulsar/` (nothing of Pulsar's is kept in this repository); this module writes its
configuration, starts `org.apache.pulsar.PulsarStandaloneStarter` in a JVM of its own, waits until
the admin API serves `public/default` and the broker's health check passes, and creates the
tenants and namespaces Apache Pulsar (unlike pulsar-lite) does not create by itself.

    python -m devtools.apache_pulsar start [--dir D] [--port P] [--http-port H]
    python -m devtools.apache_pulsar stop [--dir D]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import jwt

from worker.broker.embedded import EmbeddedError, Service, free_port, pid_alive

CLUSTER = "standalone"
HOME = Path(os.environ.get("PUSH_WORKER_APACHE_PULSAR_HOME")
            or Path(__file__).resolve().parents[1] / "tools" / "apache-pulsar")
READY_TIMEOUT = 180.0  # first start on a busy 2-core machine; measured ~8-10 s when idle

# What `bin/pulsar` passes to the JVM: Netty and BookKeeper need these opens on Java 17, and the
# bookie finds its metadata in the standalone's RocksDB store through Pulsar's drivers.
JVM_OPTIONS = [
    "-Djava.net.preferIPv4Stack=true",
    "-Dio.netty.tryReflectionSetAccessible=true",
    "--add-opens", "java.base/java.io=ALL-UNNAMED",
    "--add-opens", "java.base/java.util.zip=ALL-UNNAMED",
    "--add-opens", "java.base/java.nio=ALL-UNNAMED",
    "--add-opens", "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-opens", "java.base/sun.net=ALL-UNNAMED",
    "--add-opens", "java.management/sun.management=ALL-UNNAMED",
    "-Dbookkeeper.metadata.bookie.drivers=org.apache.pulsar.metadata.bookkeeper.PulsarMetadataBookieDriver",
    "-Dbookkeeper.metadata.client.drivers=org.apache.pulsar.metadata.bookkeeper.PulsarMetadataClientDriver",
]
MEMORY = ["-Xms128m", "-Xmx768m", "-XX:MaxDirectMemorySize=512m"]

# Read twice by the standalone starter: as the broker's and as the embedded bookie's configuration.
# The code's defaults differ from the distribution's conf/standalone.conf; what a single-node broker
# on loopback needs is set here explicitly.
CONFIG = """\
clusterName={cluster}
bindAddress=127.0.0.1
advertisedAddress=127.0.0.1
brokerServicePort={port}
webServicePort={http_port}
managedLedgerDefaultEnsembleSize=1
managedLedgerDefaultWriteQuorum=1
managedLedgerDefaultAckQuorum=1
loadManagerClassName=org.apache.pulsar.broker.loadbalance.NoopLoadManager
allowAutoTopicCreation=true
allowAutoTopicCreationType=non-partitioned
brokerDeleteInactiveTopicsEnabled=false
brokerShutdownTimeoutMs=5000
# Topic stats and /metrics refresh every 2 s (default 60 s): backlog readings follow the tests.
statsUpdateFrequencyInSecs=2
statsUpdateInitialDelayInSecs=2
exposePreciseBacklogInPrometheus=true
managedLedgerCacheSizeMB=64
# The bookie's frame limit a little above the broker's 5 MB message limit, as the distribution sets
# it: at the code's default (exactly 5 MB) a message near the limit (a full chunk of a chunked one)
# is refused by the bookie, which then drops out and every later write fails.
nettyMaxFrameSizeBytes=5253120
dbStorage_writeCacheMaxSizeMb=32
dbStorage_readAheadCacheMaxSizeMb=32
# The journal is written but not fsynced per entry: a killed broker process loses nothing (the page
# cache survives it); a power loss could. This is a test and development broker.
journalSyncData=false
"""

# Token authentication and authorization, as production clusters run; the broker's own client (it
# creates public/default at start) authenticates as the super-user.
AUTH_CONFIG = """\
authenticationEnabled=true
authenticationProviders=org.apache.pulsar.broker.authentication.AuthenticationProviderToken
tokenSecretKey=data:;base64,{secret}
authorizationEnabled=true
superUserRoles=admin
brokerClientAuthenticationPlugin=org.apache.pulsar.client.impl.auth.AuthenticationToken
brokerClientAuthenticationParameters=token:{token}
authenticateMetricsEndpoint=true
"""

# TLS beside the plain ports (which the broker's own client and the readiness checks keep using).
TLS_CONFIG = """\
brokerServicePortTls={port}
webServicePortTls={https_port}
tlsCertificateFilePath={cert}
tlsKeyFilePath={key}
tlsTrustCertsFilePath={cert}
"""

LOG4J = """\
Configuration:
  status: warn
  Appenders:
    Console:
      name: Console
      target: SYSTEM_OUT
      PatternLayout:
        Pattern: "%d{ISO8601} %-5level [%t] %c{1} - %msg%n"
  Loggers:
    Root:
      level: {level}
      AppenderRef:
        - ref: Console
"""


def lib_dir() -> Path:
    return HOME / "lib"


def ensure_resolved() -> Path:
    """The broker's jars, resolved from Maven Central on first use (about 235 MB, ~20-40 s)."""
    lib, pom = lib_dir(), HOME / "pom.xml"
    stamp = lib / ".resolved"
    if stamp.exists() and stamp.stat().st_mtime >= pom.stat().st_mtime:
        return lib
    mvn = shutil.which("mvn")
    if not mvn:
        raise EmbeddedError("Apache Pulsar needs Maven (mvn) to resolve the broker from Maven Central")
    # -s: the project's settings.xml sends every repository a dependency names to Central.
    done = subprocess.run([mvn, "-q", "-B", "-s", str(HOME / "settings.xml"), "-f", str(pom), "package"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        raise EmbeddedError(f"resolving Apache Pulsar from Maven Central failed:\n{tail}")
    stamp.touch()
    return lib


GUARD = Path(__file__).resolve().parents[1] / "deploy" / "pulsar-guard"
GUARD_NAR = GUARD / "target" / "nar" / "pulsar-guard.nar"
# push-worker's broker-side guard (deploy/pulsar-guard), as a platform installs it: an entry filter
# the broker loads from a directory of NAR files, enabled for every topic.
GUARD_CONFIG = """\
entryFiltersDirectory={directory}
entryFilterNames=push-worker-guard
"""


def ensure_guard() -> Path:
    """The guard's NAR (`make pulsar-guard`), built with Maven when missing or older than its sources."""
    sources = [path for path in GUARD.rglob("*") if path.is_file() and "target" not in path.relative_to(GUARD).parts]
    if GUARD_NAR.exists() and GUARD_NAR.stat().st_mtime >= max(path.stat().st_mtime for path in sources):
        return GUARD_NAR
    mvn = shutil.which("mvn")
    if not mvn:
        raise EmbeddedError("the broker guard needs Maven (mvn) to build deploy/pulsar-guard")
    done = subprocess.run([mvn, "-q", "-B", "-s", str(HOME / "settings.xml"), "-f", str(GUARD / "pom.xml"), "package"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
        raise EmbeddedError(f"building deploy/pulsar-guard failed:\n{tail}")
    # A NAR is a jar the broker unpacks into a class loader of its own: the jar as it is, named .nar.
    GUARD_NAR.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(GUARD / "target" / "pulsar-guard.jar", GUARD_NAR)
    return GUARD_NAR


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not java or not Path(java).exists():
        raise EmbeddedError("Apache Pulsar needs Java 17+ (java on PATH or JAVA_HOME)")
    return java


def admin_request(admin_url: str, method: str, path: str, body: object | None = None,
                  timeout: float = 10.0, token: str = "") -> tuple[int, bytes]:
    if not admin_url.startswith(("http://", "https://")):
        raise EmbeddedError(f"the Pulsar admin URL must be http(s)://, not {admin_url!r}")
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(admin_url.rstrip("/") + path, data=data, method=method,  # noqa: S310 - http(s) only
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - our admin URL
            return int(response.status), response.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()


def ensure_namespace(admin_url: str, tenant: str, namespace: str = "main", token: str = "") -> None:
    """Create `tenant` and `tenant/namespace` if missing (Apache Pulsar creates neither by itself)."""
    status, _ = admin_request(admin_url, "GET", f"/admin/v2/namespaces/{tenant}/{namespace}", token=token)
    if status == 200:
        return
    _, clusters = admin_request(admin_url, "GET", "/admin/v2/clusters", token=token)
    _create(admin_url, f"/admin/v2/tenants/{tenant}", {"adminRoles": [], "allowedClusters": json.loads(clusters)},
            token, f"tenant {tenant}")
    _create(admin_url, f"/admin/v2/namespaces/{tenant}/{namespace}", None, token, f"namespace {tenant}/{namespace}")


def _create(admin_url: str, path: str, body: object | None, token: str, what: str) -> None:
    """PUT `path` unless it exists. Test processes running at once create the same tenants: the
    broker's metadata store then refuses all but one write (HTTP 500, BadVersionException), and the
    others find it created."""
    for attempt in range(10):
        status, answer = admin_request(admin_url, "PUT", path, body, token=token)
        if status in (204, 409) or admin_request(admin_url, "GET", path, token=token)[0] == 200:
            return
        time.sleep(0.1 * (attempt + 1))
    raise EmbeddedError(f"creating {what} failed: HTTP {status} {answer[:200]!r}")


def ensure_topic_namespace(admin_url: str, topic: str) -> None:
    """The namespace of `persistent://tenant/namespace/name`."""
    tenant, namespace = topic.split("://", 1)[1].split("/")[:2]
    ensure_namespace(admin_url, tenant, namespace)


def create_partitioned_topic(admin_url: str, topic: str, partitions: int) -> None:
    ensure_topic_namespace(admin_url, topic)
    path = "/admin/v2/persistent/" + topic.split("://", 1)[1] + "/partitions"
    status, body = admin_request(admin_url, "PUT", path, partitions)
    if status not in (204, 409):
        raise EmbeddedError(f"creating partitioned topic {topic} failed: HTTP {status} {body[:200]!r}")


def is_ready(admin_url: str, token: str = "") -> bool:
    """The admin API serves public/default (created after the broker reports ready) and the
    broker's own health check (a round trip through a topic) passes."""
    try:
        status, _ = admin_request(admin_url, "GET", "/admin/v2/namespaces/public/default", timeout=5, token=token)
        if status != 200:
            return False
        status, body = admin_request(admin_url, "GET", "/admin/v2/brokers/health", timeout=30, token=token)
        return status == 200 and body.strip() == b"ok"
    except OSError:
        return False


@dataclass
class RunningBroker:
    """A broker someone else started (`make apache-pulsar`, a cluster): used, never stopped."""

    url: str
    admin_url: str
    name: str = "apache-pulsar"

    @property
    def metrics_url(self) -> str:
        return self.admin_url.rstrip("/") + "/metrics/"  # /metrics answers with a redirect here

    def stop(self) -> None:
        """Not ours to stop."""


def broker_from_environment(tenants: tuple[str, ...]) -> RunningBroker | None:
    """`PULSAR_URL` (and `PULSAR_ADMIN_URL`, to create `tenants`' `main` namespaces): the broker
    `make bench` and `make soak` use instead of starting pulsar-lite; None when unset."""
    url = os.environ.get("PULSAR_URL")
    if not url:
        return None
    admin = os.environ.get("PULSAR_ADMIN_URL", "")
    if not admin:
        raise EmbeddedError("PULSAR_URL is set: set PULSAR_ADMIN_URL too (make apache-pulsar prints both)")
    broker = RunningBroker(url, admin)
    for tenant in tenants:
        ensure_namespace(admin, tenant)
    return broker


@dataclass
class ApachePulsar(Service):
    """A standalone broker process; `restart` keeps its data (for outage tests)."""

    admin_url: str = ""
    admin_token: str = ""  # when it authenticates clients: a token of its super-user role
    tls_url: str = ""  # when it serves TLS too: pulsar+ssl:// and https:// beside the plain ports
    tls_admin_url: str = ""

    def restart(self) -> None:
        self.stop()
        self.start_again()

    def start_again(self) -> None:
        """After a kill or stop: the same ports, the same data."""
        self.proc = _spawn(self.argv, self.cwd, self.log_path)
        wait_ready(self)


def _spawn(argv: list[str], cwd: Path | None, log_path: Path | None) -> subprocess.Popen[bytes]:
    with open(log_path or os.devnull, "ab") as log:
        return subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait_ready(broker: ApachePulsar, timeout: float = READY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if broker.proc.poll() is not None:
            raise EmbeddedError(f"Apache Pulsar exited with code {broker.proc.returncode} while starting; "
                                f"its log: {broker.log_path}\n{_log_tail(broker.log_path)}")
        if is_ready(broker.admin_url, broker.admin_token):
            return
        time.sleep(0.25)
    broker.kill()
    raise EmbeddedError(f"Apache Pulsar was not ready within {timeout:g}s; its log: {broker.log_path}")


def _log_tail(path: Path | None, lines: int = 8) -> str:
    if not path or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(line for line in text if " ERROR " in line or "Exception" in line)[-2000:] or \
        "\n".join(text[-lines:])


def token(secret: bytes, role: str) -> str:
    """A token (HS256 JWT) of `role` for a broker started with `token_secret=secret`."""
    return jwt.encode({"sub": role}, secret, algorithm="HS256")


def start(state_dir: Path, port: int | None = None, http_port: int | None = None,
          log_level: str | None = None, token_secret: bytes | None = None,
          tls: tuple[Path, Path] | None = None, guard: bool = True) -> ApachePulsar:
    """A standalone broker with a fresh data directory under `state_dir`, on loopback, with
    push-worker's broker guard loaded (`guard`, on unless a benchmark compares). With
    `token_secret`, clients must authenticate with tokens it signed (`token()`), role `admin` is
    the super-user, and other roles may do what they were granted. With `tls` (a PEM certificate
    for 127.0.0.1 and its key), it serves TLS on ports of its own too."""
    lib = ensure_resolved()
    state_dir = state_dir.absolute()
    shutil.rmtree(state_dir / "data", ignore_errors=True)
    # The JVM's temporary files (RocksDB unpacks a 13 MB library there at every start) go with the
    # data: /tmp would keep one per start, a kill leaves them behind.
    tmp = state_dir / "data" / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    port, http_port = port or free_port(), http_port or free_port()
    conf = state_dir / "standalone.conf"
    admin_token = token(token_secret, "admin") if token_secret else ""
    auth = AUTH_CONFIG.format(secret=base64.b64encode(token_secret).decode(), token=admin_token) if token_secret else ""
    tls_port, https_port = (free_port(), free_port()) if tls else (0, 0)
    tls_config = TLS_CONFIG.format(port=tls_port, https_port=https_port, cert=tls[0].absolute(),
                                   key=tls[1].absolute()) if tls else ""
    plugins = GUARD_CONFIG.format(directory=ensure_guard().parent) if guard else ""
    conf.write_text(CONFIG.format(cluster=CLUSTER, port=port, http_port=http_port) + auth + tls_config + plugins)
    level = log_level or os.environ.get("APACHE_PULSAR_LOG_LEVEL", "warn")
    (state_dir / "log4j2.yaml").write_text(LOG4J.replace("{level}", level))
    argv = [java_binary(), *MEMORY, "-cp", f"{state_dir}:{lib}/*",
            "-Dlog4j.configurationFile=log4j2.yaml", f"-Djava.io.tmpdir={tmp}", *JVM_OPTIONS,
            "org.apache.pulsar.PulsarStandaloneStarter", "-c", str(conf), "-nfw", "-nss", "-a", "127.0.0.1",
            "--metadata-dir", str(state_dir / "data" / "metadata"),
            "--bookkeeper-dir", str(state_dir / "data" / "bookkeeper")]
    log_path = state_dir / "apache-pulsar.log"
    broker = ApachePulsar("apache-pulsar", _spawn(argv, state_dir, log_path), port, f"pulsar://127.0.0.1:{port}",
                          argv, state_dir, log_path, f"http://127.0.0.1:{http_port}/metrics/",
                          admin_url=f"http://127.0.0.1:{http_port}", admin_token=admin_token,
                          tls_url=f"pulsar+ssl://127.0.0.1:{tls_port}" if tls else "",
                          tls_admin_url=f"https://127.0.0.1:{https_port}" if tls else "")
    wait_ready(broker)
    return broker


# -- make apache-pulsar / apache-pulsar-stop -------------------------------------------------------

def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.apache_pulsar",
                                     description="Start or stop an Apache Pulsar standalone broker in the background.")
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--dir", type=Path, default=Path(".apache-pulsar"),
                        help="its configuration, data (fresh at each start), log and pid file")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PULSAR_PORT", "6650")),
                        help="the Pulsar protocol port on 127.0.0.1 (default $PULSAR_PORT or 6650)")
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("PULSAR_HTTP_PORT", "8080")),
                        help="the admin API and /metrics port on 127.0.0.1 (default $PULSAR_HTTP_PORT or 8080)")
    args = parser.parse_args(argv)
    pid_file = args.dir.absolute() / "pid"
    try:
        if args.action == "stop":
            return _stop(pid_file)
        if pid_file.exists() and pid_alive(int(pid_file.read_text())):
            print(f"apache-pulsar: already running (pid {pid_file.read_text().strip()}); "
                  "make apache-pulsar-stop first", file=sys.stderr)
            return 1
        began = time.monotonic()
        broker = start(args.dir, args.port, args.http_port, log_level="info")
    except EmbeddedError as e:
        print(f"apache-pulsar: {e}", file=sys.stderr)
        return 1
    pid_file.write_text(str(broker.proc.pid))
    print(f"Apache Pulsar ready in {time.monotonic() - began:.1f}s (pid {broker.proc.pid}, log {broker.log_path})")
    print(f"PULSAR_URL={broker.url}")
    print(f"PULSAR_ADMIN_URL={broker.admin_url}")
    return 0


def _stop(pid_file: Path) -> int:
    if not pid_file.exists():
        print("apache-pulsar: not running (no pid file)")
        return 0
    pid = int(pid_file.read_text())
    if pid_alive(pid):
        terminate_pid(pid)
    pid_file.unlink()
    print(f"apache-pulsar: stopped (pid {pid})")
    return 0


def terminate_pid(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` (not our child here: `make` started it earlier)."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(_main())
