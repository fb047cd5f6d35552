"""deploy/ offline: kustomize renders, objects validate against the Kubernetes schemas, and the
pieces refer to each other correctly (HPA -> Deployment, metric names, ports, grace period)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from devtools import releases
from worker.core.metrics import Metrics
from worker.model.config import parse_settings

pytestmark = pytest.mark.broker_independent

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
needs_kubectl = pytest.mark.skipif(not shutil.which("kubectl") and not os.environ.get("CI"),
                                   reason="kubectl not installed (CI installs Debian's package)")
CRDS = {"ServiceMonitor", "ScaledObject"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "overlays" / "example")], capture_output=True,
                         text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    # By kind, and by kind/name where a kind has several (the workers' and the admin process's)
    return {d["kind"]: d for d in docs if d["metadata"]["name"] != "push-worker-admin"} | \
        {f'{d["kind"]}/{d["metadata"]["name"]}': d for d in docs}


def exported_metric_names() -> set[str]:
    names = set()
    for metric in Metrics().registry.collect():
        names.add(metric.name)
        names.update(s.name for s in metric.samples)
    return names


@needs_kubectl
def test_every_object_validates(rendered):
    assert {"Namespace", "ServiceAccount", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "ServiceMonitor"} <= set(rendered)
    for obj in rendered.values():
        kind = obj["kind"]
        if kind not in CRDS:
            kubernetes_validate.validate(obj, "1.30", strict=True)
        assert kind == "Namespace" or obj["metadata"]["namespace"] == "pubsub"
    keda = yaml.safe_load((DEPLOY / "keda" / "scaledobject.yaml").read_text())
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["spec"]["triggers"][0]["type"] == "prometheus"
    sm = rendered["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["spec"]["endpoints"][0]["path"] == "/metrics"


@needs_kubectl
def test_cross_references(rendered):
    deployment, hpa = rendered["Deployment"], rendered["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300

    # The HPA's metric is what the adapter rule serves, and the adapter reads a metric the worker exports.
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())
    [rule] = adapter["externalRules"]
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == rule["name"]["as"]
    exported = exported_metric_names()
    assert re.match(r"(\w+)", rule["seriesQuery"]).group(1) in exported
    keda = yaml.safe_load((DEPLOY / "keda" / "scaledobject.yaml").read_text())
    assert keda["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert set(re.findall(r"pushworker_\w+", keda["spec"]["triggers"][0]["metadata"]["query"])) <= exported
    # The scaler of the fleet's own namespace only, as the adapter rule; the HPA alone owns the count
    # (a replicas field anywhere would be re-applied by every `kubectl apply`); the admin URL is one of
    # two backlog sources (the other, pulsar.metrics_url, is in worker.yaml): its Secret key is optional.
    assert 'namespace="pubsub"' in keda["spec"]["triggers"][0]["metadata"]["query"]
    assert "replicas" not in deployment["spec"]
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PUSH_WORKER_PULSAR_ADMIN_URL"]["valueFrom"]["secretKeyRef"]["optional"] is True

    # The config in the ConfigMap is valid, and its port is the one probes and the Service use.
    settings = parse_settings(yaml.safe_load(rendered["ConfigMap"]["data"]["worker.yaml"]), env={})
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == settings.http.port and settings.http.host == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "http"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    service = rendered["Service"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert rendered["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]

    # Grace: the longest allowed ack deadline (600 s) plus the drain grace fits before SIGKILL.
    assert pod["terminationGracePeriodSeconds"] > 600 + settings.shutdown_grace_seconds

    # Selectors match the pods; the pods run non-root with a read-only root filesystem.
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (deployment["spec"]["selector"]["matchLabels"], rendered["PodDisruptionBudget"]["spec"]["selector"]
                     ["matchLabels"], service["spec"]["selector"]):
        assert selector.items() <= labels.items()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["topologySpreadConstraints"]
    # Credentials come from Secrets, never from the ConfigMap.
    env = {e["name"]: e for e in container["env"]}
    for name in ("PUSH_WORKER_PULSAR_URL", "PUSH_WORKER_REDIS_URL", "PUSH_WORKER_PULSAR_TOKEN"):
        assert "secretKeyRef" in env[name]["valueFrom"]
    assert "redis://" not in rendered["ConfigMap"]["data"]["worker.yaml"]
    # The image listens where the Deployment expects and runs as the same non-root user.
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert f"EXPOSE {ports['http']}" in dockerfile
    assert f"USER {pod['securityContext']['runAsUser']}" in dockerfile


@needs_kubectl
def test_the_admin_process_has_its_own_deployment_probes_and_service(rendered):
    """`push-worker admin` on pods of its own: its ports are the config's, its probes its status
    listener's, its Service the admin port, the tokens' and projects' secrets mounted where the
    config reads them, non-root and bounded like the workers."""
    admin = rendered["Deployment/push-worker-admin"]
    settings = parse_settings(yaml.safe_load(rendered["ConfigMap"]["data"]["worker.yaml"]), env={})
    assert settings.admin is not None and settings.admin.host == "0.0.0.0"
    pod = admin["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"] + container["args"] == ["push-worker", "admin", "--config",
                                                         "/etc/push-worker/worker.yaml"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.http.port, "admin": settings.admin.port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    service = rendered["Service/push-worker-admin"]
    assert service["spec"]["ports"][0]["targetPort"] == "admin"
    labels = admin["spec"]["template"]["metadata"]["labels"]
    for selector in (admin["spec"]["selector"]["matchLabels"], service["spec"]["selector"],
                     rendered["PodDisruptionBudget/push-worker-admin"]["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    # Never the workers' pods: their selectors do not match the admin pods, nor the other way round.
    worker_labels = rendered["Deployment/push-worker"]["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker_labels.items()
    assert not rendered["Service/push-worker"]["spec"]["selector"].items() <= labels.items()
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert all(any(t.file.startswith(m + "/") for m in mounts) for t in settings.admin.tokens)
    assert str(settings.secrets_dir) in mounts
    projected = {v["name"]: v for v in pod["volumes"]}["project-secrets"]["projected"]["sources"]
    workers = {v["name"]: v for v in rendered["Deployment/push-worker"]["spec"]["template"]["spec"]["volumes"]}
    assert projected == workers["project-secrets"]["projected"]["sources"] and projected  # the overlay's, both
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = {e["name"]: e for e in container["env"]}
    for name in ("PUSH_WORKER_PULSAR_URL", "PUSH_WORKER_REDIS_URL", "PUSH_WORKER_PULSAR_TOKEN"):
        assert "secretKeyRef" in env[name]["valueFrom"]


def test_alerts_use_the_job_name_the_service_monitor_produces():
    rules = (ROOT / "grafana" / "alerts" / "push-worker.rules.yaml").read_text()
    sm = yaml.safe_load((DEPLOY / "base" / "servicemonitor.yaml").read_text())
    kustomization = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    job = kustomization["labels"][0]["pairs"][sm["spec"]["jobLabel"]]
    assert f'job="{job}"' in rules


def test_the_image_lock_pins_every_runtime_dependency_with_hashes_at_the_tested_versions():
    lock = (DEPLOY / "requirements.txt").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", lock, re.M))
    blocks = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", lock)
    assert all("--hash=sha256:" in block for block in blocks if "==" in block.split("\n")[0])
    tested = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.lock").read_text(), re.M))

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    tested = {norm(k): v for k, v in tested.items()}
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in runtime:
        name = norm(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])
        assert name in {norm(k) for k in pinned}, f"{name} is not in deploy/requirements.txt"
    for name, version in pinned.items():
        if norm(name) in tested:
            assert tested[norm(name)] == version, f"{name}: image {version}, tested {tested[norm(name)]}"
    assert {"pip", "setuptools"} <= {norm(k) for k in pinned}  # the build tools too


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("buildah") and shutil.which("mmdebstrap")) and not os.environ.get("CI"),
                    reason="buildah and mmdebstrap not installed (make deps installs Debian's)")
@pytest.mark.timeout(1200)  # a Debian base, then a wheel build: mypyc compiles core/, minutes on 2 busy cores
def test_the_image_builds_and_runs_version_and_check_on_the_deployed_config(tmp_path):
    """deploy/Dockerfile built by buildah (devtools/image.py; the base is Debian's Python where no
    registry is reachable, as on the project's machines), in a storage of the test's own: the
    hashed lock installs with --require-hashes, the package is a wheel built by its hook (worker/core
    compiled with mypyc), pip check passes, every per-message module imports compiled (the build's
    last step fails otherwise). In a container of it, as its non-root user: `push-worker --version`
    names this commit, and `check` accepts the config deploy/base ships."""
    from devtools.image import Buildah, head_commit
    from worker.runtime.release import commits_since

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "--require-hashes --no-deps -r deploy/requirements.txt" in dockerfile
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim@sha256:[0-9a-f]{64}$", dockerfile, re.M)
    assert "devtools" not in dockerfile.split("FROM ${PYTHON_IMAGE}\n")[-1]  # nothing of the tools ships
    buildah = Buildah(tmp_path)
    commit = head_commit()
    since = commits_since(releases.project_version(), ROOT)  # of the commit built, counted as the build counts
    try:
        buildah.build("localhost/push-worker:test", commit, base="debian")
        version = buildah.run("localhost/push-worker:test", "push-worker", "--version")
        described = releases.project_version() + (f"+{since}.g{commit[:7]}" if since else "")
        assert version.stdout == f"push-worker {described} (commit {commit[:12]})\n", version
        checked = buildah.run("localhost/push-worker:test", "push-worker", "check", "--config",
                              "/etc/push-worker/worker.yaml", mounts={DEPLOY / "base" / "worker.yaml":
                                                                      "/etc/push-worker/worker.yaml"})
        assert checked.returncode == 0 and checked.stdout.startswith("ok: "), checked
        who = buildah.run("localhost/push-worker:test", "id", "-u")
        assert who.stdout.strip() == "10001"
        state = buildah.run("localhost/push-worker:test", "python", "-c",
                            "from worker.runtime import compiled; print(compiled.state())")
        assert state.stdout.strip() == "compiled (mypyc)", state
        shipped = buildah.run("localhost/push-worker:test", "python", "-c",
                              "import importlib.util as u; print(u.find_spec('devtools'))")
        assert shipped.stdout.strip() == "None"  # what ships is the product: no development tools
        offered = buildah.run("localhost/push-worker:test", "push-worker", "--help").stdout
        assert "subs" in offered and not any(tool in offered for tool in ("demo", "bench", "soak"))
        config = buildah.config("localhost/push-worker:test")
        assert config["Entrypoint"] == ["push-worker", "run", "--config", "/etc/push-worker/worker.yaml"]
        assert config["Labels"]["org.opencontainers.image.revision"] == commit
    finally:
        subprocess.run(["buildah", *buildah.options, "rm", "--all"], capture_output=True, timeout=120)
        subprocess.run(["buildah", *buildah.options, "rmi", "--all", "--force"], capture_output=True, timeout=300)


@needs_kubectl
def test_a_change_to_the_config_rolls_both_deployments(tmp_path):
    """The ConfigMap is named by its content (configMapGenerator): an edited worker.yaml renders a
    new name in both pod templates, which is what makes Kubernetes roll them."""
    def mounted_configs(deploy: Path) -> dict[str, str]:
        out = subprocess.run(["kubectl", "kustomize", str(deploy / "overlays" / "example")], capture_output=True,
                             text=True, check=True).stdout
        return {d["metadata"]["name"]: next(v["configMap"]["name"] for v in d["spec"]["template"]["spec"]["volumes"]
                                            if "configMap" in v)
                for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"}

    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("target", "pulsar-guard"))
    before = mounted_configs(copy)
    config = copy / "base" / "worker.yaml"
    config.write_text(config.read_text().replace("shutdown_grace_seconds: 60", "shutdown_grace_seconds: 45"))
    after = mounted_configs(copy)
    assert set(before) == set(after) == {"push-worker", "push-worker-admin"}
    assert len(set(before.values())) == 1 and before["push-worker"].startswith("push-worker-config-")
    assert len(set(after.values())) == 1 and after["push-worker"] != before["push-worker"]


def test_the_manifests_run_the_image_of_this_version():
    """The base's and the overlay's image tags are the version in pyproject.toml: a release that
    forgets them would deploy the one before."""
    version = releases.project_version()
    tags = re.findall(r"image: push-worker:(\S+)", "".join(p.read_text() for p in (DEPLOY / "base").glob("*.yaml")))
    tags += re.findall(r"newTag: (\S+)", (DEPLOY / "overlays" / "example" / "kustomization.yaml").read_text())
    assert tags and set(tags) == {version}
