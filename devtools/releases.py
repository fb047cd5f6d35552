"""The release record: CHANGELOG.md's sections and the commits of the releases.

Each release is a section `## [X.Y.Z] - YYYY-MM-DD` with three headings (for operators, for endpoint
owners, compatibility) and, once made, a line `[X.Y.Z]: <commit>` at the end of the file, added by
the commit after the release's own (a commit cannot name itself). The upgrade tests run against
the newest recorded release that is not the checkout itself (`previous`); `make release` checks a
release before it is built (`python -m devtools.releases check`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = ROOT / "CHANGELOG.md"
HEADINGS = ("For operators", "For endpoint owners", "Compatibility")
SECTION = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?[^\n]*$", re.M)
RECORD = re.compile(r"^\[(?P<version>\d+\.\d+\.\d+)\]: (?P<commit>[0-9a-f]{40})$", re.M)
SEMVER = re.compile(r"^(\d+)\.(\d+)\.(\d+)$")


class ReleaseError(Exception):
    """The record and the version disagree, or a release is not where the record says."""


@dataclass(frozen=True)
class Release:
    version: str
    commit: str

    @property
    def order(self) -> tuple[int, int, int]:
        major, minor, patch = (int(part) for part in SEMVER.fullmatch(self.version).groups())  # type: ignore[union-attr]
        return major, minor, patch


def sections(text: str) -> dict[str, tuple[str, str]]:
    """Every `## [version] - date` section: version -> (date, body); `Unreleased` has no date."""
    found = list(SECTION.finditer(text))
    out = {}
    for match, following in zip(found, [*found[1:], None], strict=True):
        end = following.start() if following else len(text)
        out[match["version"]] = (match["date"] or "", text[match.end():end])
    return out


def recorded(text: str) -> list[Release]:
    """The releases whose commit the record names, newest first."""
    return sorted((Release(m["version"], m["commit"]) for m in RECORD.finditer(text)),
                  key=lambda r: r.order, reverse=True)


def project_version(root: Path = ROOT) -> str:
    return str(tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"])


def _git(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)


def previous(root: Path = ROOT) -> Release:
    """The newest recorded release that is an ancestor of the checkout and not the checkout itself
    (HEAD counts as another release once the package's sources differ from it): what a rolling
    upgrade to this checkout, and a rollback from it, run beside."""
    head = _git("rev-parse", "HEAD", root=root).stdout.strip()
    edited = _git("diff", "--quiet", "HEAD", "--", "worker", root=root).returncode != 0
    for release in recorded((root / "CHANGELOG.md").read_text()):
        if release.commit == head and not edited:
            continue
        ancestor = _git("merge-base", "--is-ancestor", release.commit, "HEAD", root=root)
        if ancestor.returncode == 0:
            return release
        if ancestor.returncode != 1:  # not a "no": the commit is not in this checkout's history
            raise ReleaseError(f"release {release.version} ({release.commit[:12]}) is not in this checkout's "
                               f"history ({ancestor.stderr.strip()}); the upgrade tests need a full clone "
                               "(git fetch --unshallow)")
    raise ReleaseError("CHANGELOG.md records no earlier release (lines `[X.Y.Z]: <commit>`)")


def check(text: str, version: str) -> list[str]:
    """What is wrong with releasing `version` from this changelog ([] when nothing is)."""
    problems = []
    if not SEMVER.fullmatch(version):
        problems.append(f"pyproject.toml's version {version!r} is not a semantic version X.Y.Z")
    found = sections(text)
    if version not in found:
        return [*problems, f"CHANGELOG.md has no section `## [{version}] - YYYY-MM-DD`"]
    date, body = found[version]
    if not date:
        problems.append(f"CHANGELOG.md's section {version} has no date")
    headings = re.findall(r"^### (.+)$", body, re.M)
    if headings != list(HEADINGS):
        problems.append(f"CHANGELOG.md's section {version} has the headings {headings}, not {list(HEADINGS)}")
    if (unreleased := found.get("Unreleased")) and re.search(r"^- ", unreleased[1], re.M):
        problems.append("CHANGELOG.md's Unreleased section still lists changes: move them into the release")
    if any(r.version == version for r in recorded(text)):
        problems.append(f"{version} is already released: raise the version")
    newest = next(iter(recorded(text)), None)
    if newest is not None and SEMVER.fullmatch(version) and Release(version, "").order <= newest.order:
        problems.append(f"{version} is not above the last release, {newest.version}")
    return problems


def build_release(version: str, text: str, base: str, allow_dirty: bool) -> int:
    """What an operator installs, into dist/: the compiled wheel, the locks, the image (OCI archive)."""
    from devtools import compile as package
    from devtools import image

    if problems := check(text, version):
        raise ReleaseError("; ".join(problems))
    if _git("status", "--porcelain", "--untracked-files=no").stdout.strip() and not allow_dirty:
        raise ReleaseError("the checkout has uncommitted changes: a release is built from a commit")
    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    package.build()
    [wheel] = package.WHEELS.glob("push_worker-*.whl")
    # The image's lock (runtime dependencies with hashes) and the versions the tests ran with.
    made = [Path(shutil.copy(source, dist / name)) for source, name in (
        (wheel, wheel.name), (ROOT / "deploy" / "requirements.txt", f"push-worker-{version}-requirements.txt"),
        (ROOT / "requirements.lock", f"push-worker-{version}-tested.lock"))]
    buildah, tag, commit = image.Buildah(), f"localhost/push-worker:{version}", image.head_commit()
    buildah.build(tag, commit, image.choose_base(base))
    said = buildah.run(tag, "push-worker", "--version").stdout.strip()
    if said != f"push-worker {version} (commit {commit[:12]})":
        raise ReleaseError(f"the image says {said!r}")
    made.append(dist / f"push-worker-{version}.oci.tar")
    buildah.save(tag, made[-1])
    print("\n".join(str(path.relative_to(ROOT)) for path in made))
    if allow_dirty:
        print(f"{version} built from uncommitted changes: not a release, not tagged")
        return 0
    tagged = _git("tag", "-a", f"v{version}", "-m", f"push-worker {version}", commit)
    if tagged.returncode != 0:
        raise ReleaseError(f"tagging v{version}: {tagged.stderr.strip()}")
    print(f"release {version} built from {commit[:12]} and tagged v{version} (push the tag with the commit); "
          f"record it in CHANGELOG.md with the next commit:\n[{version}]: {commit}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.releases", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="the changelog has this version's section, as a release needs it")
    sub.add_parser("previous", help="the previous release's version and commit")
    sub.add_parser("record", help="the line that records the checkout as this version's release")
    build = sub.add_parser("build", help="check, then the wheel, the locks and the image into dist/ (make release)")
    build.add_argument("--base", choices=("auto", "pinned", "debian"), default="auto",
                       help="the image's base (devtools/image.py); auto: pinned where a registry answers")
    build.add_argument("--allow-dirty", action="store_true", help="build uncommitted changes (not a release)")
    args = parser.parse_args(argv)
    text, version = CHANGELOG.read_text(), project_version()
    try:
        if args.command == "check":
            if problems := check(text, version):
                print("\n".join(f"release {version}: {p}" for p in problems), file=sys.stderr)
                return 2
            print(f"release {version}: the changelog and the version agree")
        elif args.command == "build":
            return build_release(version, text, args.base, args.allow_dirty)
        elif args.command == "previous":
            release = previous()
            print(release.version, release.commit)
        else:
            print(f"[{version}]: {_git('rev-parse', 'HEAD').stdout.strip()}")
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:  # a build step failed: its own words
        print(f"release: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
