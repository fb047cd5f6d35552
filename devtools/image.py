"""The image, built without a daemon: buildah (vfs storage, chroot isolation: as root on a machine
with no container engine), from deploy/Dockerfile.

The Dockerfile's base is python:3.11-slim, pinned by digest. Where no container registry is
reachable (the project's build machines), `--base debian` builds an equivalent base first:
Debian bookworm's Python 3.11 made into an image by mmdebstrap, passed as PYTHON_IMAGE with its
C headers for the build stage. `python -m devtools.image build|run|save --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from worker.runtime.release import commits_since

ROOT = Path(__file__).resolve().parent.parent
DEBIAN_BASE = "localhost/push-worker-base:bookworm"
DEBIAN_PACKAGES = "python3.11,python3.11-venv,python-is-python3,passwd,ca-certificates"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")  # trusted by the build's pip (a TLS-inspecting proxy)


class Buildah:
    """buildah with one storage: the machine's (`root` None) or a directory of its own (tests)."""

    def __init__(self, root: Path | None = None) -> None:
        self.options = ["--storage-driver", "vfs"]
        if root is not None:
            self.options += ["--root", str(root / "storage"), "--runroot", str(root / "run")]

    def __call__(self, *args: str, timeout: float = 1800, **kwargs: object) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["buildah", *self.options, *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "BUILDAH_ISOLATION": "chroot"}, **kwargs)  # type: ignore[call-overload]
        if done.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args[:2])} failed ({done.returncode}): "
                               f"{(done.stderr or done.stdout)[-3000:]}")
        return done  # type: ignore[no-any-return]

    def has(self, image: str) -> bool:
        return subprocess.run(["buildah", *self.options, "inspect", "--type", "image", image],
                              capture_output=True, timeout=60).returncode == 0

    def debian_base(self) -> str:
        """Debian bookworm with Python 3.11, as an image (made once per storage)."""
        if not self.has(DEBIAN_BASE):
            with tempfile.TemporaryDirectory() as scratch:
                tar = Path(scratch) / "base.tar"
                subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={DEBIAN_PACKAGES}",
                                "bookworm", str(tar)], check=True, timeout=900, capture_output=True)
                container = self("from", "scratch").stdout.strip()
                try:
                    self("add", container, str(tar), "/")
                    self("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                         container)
                    self("commit", "--quiet", container, DEBIAN_BASE)
                finally:
                    self("rm", container)
        return DEBIAN_BASE

    def build(self, tag: str, commit: str, base: str = "pinned") -> None:
        """deploy/Dockerfile as `tag`, recording `commit` and how far past its release it is (`push-worker
        --version`)."""
        since = commits_since(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"], ROOT)
        args = ["--build-arg", f"COMMIT={commit}", "--build-arg", f"SINCE_RELEASE={'' if since is None else since}"]
        if base == "debian":
            args += ["--build-arg", f"PYTHON_IMAGE={self.debian_base()}",
                     "--build-arg", "BUILD_PACKAGES=python3.11-dev"]
        if HOST_CA.exists():
            args += ["--volume", f"{HOST_CA}:/run/host-ca.crt:ro", "--build-arg", "PIP_CERT=/run/host-ca.crt"]
        self("bud", "--isolation", "chroot", "--layers=false", "--quiet", "-f", "deploy/Dockerfile", *args,
             "-t", tag, ".", cwd=ROOT)

    def run(self, image: str, *argv: str, mounts: dict[Path, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`argv` in a container of `image`, as its user; `mounts`: host file -> path, read-only."""
        container = self("from", "--quiet", image).stdout.strip()
        volumes = [option for host, inside in (mounts or {}).items() for option in ("--volume", f"{host}:{inside}:ro")]
        try:
            return subprocess.run(["buildah", *self.options, "run", "--isolation", "chroot", *volumes, container,
                                   "--", *argv], capture_output=True, text=True, timeout=300)
        finally:
            self("rm", container)

    def config(self, image: str) -> dict[str, Any]:
        """The image's OCI config (Entrypoint, User, Labels...)."""
        return dict(json.loads(self("inspect", "--type", "image", image).stdout)["OCIv1"]["config"])

    def save(self, image: str, path: Path) -> None:
        """The image as an OCI archive (`podman load -i`, `skopeo copy oci-archive:...`)."""
        path.unlink(missing_ok=True)
        self("push", "--quiet", image, f"oci-archive:{path}:{image.rpartition('/')[2]}")


def registry_answers() -> bool:
    """Whether Docker Hub's registry answers here (the pinned base comes from it)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen("https://registry-1.docker.io/v2/", timeout=5)
    except urllib.error.HTTPError:
        return True  # 401: it answers (pulls authenticate anonymously)
    except (OSError, ValueError):
        return False
    return True


def choose_base(base: str) -> str:
    if base != "auto":
        return base
    chosen = "pinned" if registry_answers() else "debian"
    print(f"image base: {chosen}" + (" (no container registry answers here)" if chosen == "debian" else ""))
    return chosen


def head_commit() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.image", description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="localhost/push-worker:dev")
    parser.add_argument("--base", choices=("auto", "pinned", "debian"), default="auto",
                        help="pinned: python:3.11-slim by digest (a registry must answer); debian: Debian's "
                             "Python, built here; auto: pinned where a registry answers")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build deploy/Dockerfile from the checkout")
    save = sub.add_parser("save", help="write the built image as an OCI archive")
    save.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    buildah = Buildah()
    try:
        if args.command == "build":
            buildah.build(args.tag, head_commit(), choose_base(args.base))
            print(buildah.run(args.tag, "push-worker", "--version").stdout.strip())
        else:
            buildah.save(args.tag, args.path)
            print(args.path)
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        print(f"image: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
