"""The pinned control-plane binaries: where they are cached and how they are built.

The versions live in the Go modules under `e2e/tools/<tool>/go.mod` (one module per tool, since
KWOK and helm require newer k8s.io libraries than the v1.34 control plane). Each tool is built
into its own cache folder whose name is keyed by the tool, its pinned version and a digest of
its module files and link flags, so a pin change rebuilds just that tool and an unchanged pin is
never rebuilt. The cache lives outside the checkout (`$KVFLEET_TOOLS_CACHE`, default
`~/.cache/kvfleet/tools`) so a fresh clone on the same machine reuses it.

    python -m kvfleet.devcluster.toolchain            # build what is missing, print the bin dirs
    python -m kvfleet.devcluster.toolchain --check    # exit 1 if anything is missing
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvfleet.devcluster.errors import ToolsMissingError

# Bump when the build recipe changes in a way the module files do not show.
RECIPE_VERSION = "1"

TOOLS_SRC_ENV = "KVFLEET_TOOLS_SRC"
TOOLS_CACHE_ENV = "KVFLEET_TOOLS_CACHE"

# KWOK's stock stages (the ones `kwokctl` installs): nodes become Ready and keep a lease, pods
# become Running/Ready, finish, and are removed on deletion. Paths inside the kwok module.
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
KWOK_STAGES_NAME = "kwok-stages.yaml"

# Argo CD's own CRDs (Application, AppProject), from the pinned argo-cd module, for the GitOps
# tests: installed on the dev cluster before the application controller starts.
ARGOCD_CRD_FILES = ("manifests/crds/application-crd.yaml", "manifests/crds/appproject-crd.yaml")
ARGOCD_CRDS_NAME = "argocd-crds.yaml"


@dataclass(frozen=True)
class Tool:
    """One Go module under e2e/tools and the binaries built from it."""

    name: str
    module_path: str  # the Go module whose version is the pin
    packages: tuple[str, ...]  # main packages to build, relative to the wrapper module
    binaries: tuple[str, ...]
    tags: tuple[str, ...] = ()  # Go build tags

    def ldflags(self, version: str) -> str:
        return " ".join(["-s", "-w", *(f"-X {x}" for x in _stamps(self.name, version))])


def _stamps(name: str, version: str) -> list[str]:
    """Version strings the upstream release builds stamp in, so clients see real versions."""
    if name == "kubernetes":
        major, minor = version.lstrip("v").split(".")[:2]
        return [
            f"{pkg}.{key}={value}"
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
            for key, value in (
                ("gitVersion", version),
                ("gitMajor", major),
                ("gitMinor", minor),
                ("gitTreeState", "clean"),
            )
        ]
    if name == "kwok":
        return [f"sigs.k8s.io/kwok/pkg/consts.Version={version.lstrip('v')}"]
    if name == "helm":
        # Helm's offline default cluster version (`helm template`) follows the control plane.
        return [
            f"helm.sh/helm/v3/internal/version.version={version}",
            "helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1",
            "helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=34",
            "helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1",
            "helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=34",
        ]
    if name == "prometheus":
        # Module v0.3MM.P is Prometheus 3.MM.P.
        minor_patch = version.lstrip("v").split(".")[1:]
        release = f"3.{int(minor_patch[0]) - 300}.{minor_patch[1]}"
        return [f"github.com/prometheus/common/version.Version={release}"]
    if name == "argocd":
        # argo-cd's Makefile stamps the VERSION file's "3.2.11"; `argocd version` adds the v.
        return [f"github.com/argoproj/argo-cd/v3/common.version={version.lstrip('v')}"]
    return []  # etcd carries its version as a constant in go.etcd.io/etcd/api/v3/version


TOOLS: tuple[Tool, ...] = (
    Tool("etcd", "go.etcd.io/etcd/server/v3", (".",), ("etcd",)),
    Tool(
        "kubernetes",
        "k8s.io/kubernetes",
        tuple(
            f"k8s.io/kubernetes/cmd/{b}"
            for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
        ),
        ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"),
    ),
    Tool("kwok", "sigs.k8s.io/kwok", ("sigs.k8s.io/kwok/cmd/kwok",), ("kwok",)),
    Tool("helm", "helm.sh/helm/v3", ("helm.sh/helm/v3/cmd/helm",), ("helm",)),
    # Debian's prometheus is built without kubernetes_sd_configs, so we build the real thing,
    # with Prometheus's own tags for a slim build: only the kubernetes (plus file and http)
    # service discovery, not the two dozen cloud SDKs, which cut the cold build severalfold.
    Tool(
        "prometheus",
        "github.com/prometheus/prometheus",
        (
            "github.com/prometheus/prometheus/cmd/prometheus",
            "github.com/prometheus/prometheus/cmd/promtool",
        ),
        ("prometheus", "promtool"),
        tags=("remove_all_sd", "enable_kubernetes_sd"),
    ),
    # One binary (`main.go` repeats argo-cd's dispatch): the CLI by default, the application
    # controller or repo server under $ARGOCD_BINARY_NAME.
    Tool("argocd", "github.com/argoproj/argo-cd/v3", (".",), ("argocd",)),
)


def _tool(name: str) -> Tool:
    return next(tool for tool in TOOLS if tool.name == name)


@dataclass(frozen=True)
class ToolPaths:
    """Absolute paths of every pinned binary, the KWOK stage file and Argo CD's CRDs."""

    binaries: dict[str, Path]
    kwok_stages: Path
    argocd_crds: Path
    versions: dict[str, str]

    def __getitem__(self, binary: str) -> Path:
        return self.binaries[binary]


def tools_src_dir() -> Path:
    env = os.environ.get(TOOLS_SRC_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "e2e" / "tools"


def cache_root() -> Path:
    env = os.environ.get(TOOLS_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "kvfleet" / "tools"


def pinned_version(src: Path, tool: Tool) -> str:
    go_mod = src / tool.name / "go.mod"
    try:
        text = go_mod.read_text()
    except FileNotFoundError as exc:
        raise ToolsMissingError(
            f"{go_mod} is missing: run from a kvfleet checkout or set {TOOLS_SRC_ENV}"
        ) from exc
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(tool.module_path)}\s+(v\S+)", text, re.M)
    if match is None:
        raise ToolsMissingError(f"{go_mod}: no `require {tool.module_path} vX.Y.Z` line")
    return match.group(1)


def cache_key(src: Path, tool: Tool) -> str:
    version = pinned_version(src, tool)
    digest = hashlib.sha256(RECIPE_VERSION.encode())
    digest.update(tool.ldflags(version).encode())
    digest.update(",".join(tool.tags).encode())
    for path in sorted((src / tool.name).iterdir()):
        if path.is_file() and path.suffix in {".mod", ".sum", ".go"}:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{tool.name}-{version}-{digest.hexdigest()[:10]}"


def tool_dir(src: Path, tool: Tool) -> Path:
    return cache_root() / cache_key(src, tool)


def locate(src: Path | None = None) -> ToolPaths:
    """The cached binaries, or ToolsMissingError naming what is missing and how to build it."""
    src = src or tools_src_dir()
    binaries: dict[str, Path] = {}
    versions: dict[str, str] = {}
    missing: list[str] = []
    for tool in TOOLS:
        folder = tool_dir(src, tool)
        versions[tool.name] = pinned_version(src, tool)
        for name in tool.binaries:
            path = folder / "bin" / name
            binaries[name] = path
            if not os.access(path, os.X_OK):
                missing.append(str(path))
    stages = tool_dir(src, _tool("kwok")) / KWOK_STAGES_NAME
    argocd_crds = tool_dir(src, _tool("argocd")) / ARGOCD_CRDS_NAME
    if missing:
        raise ToolsMissingError(
            f"control-plane binaries not built: {', '.join(missing)}; "
            "run e2e/tools/build.sh (tens of minutes cold, seconds when cached)"
        )
    return ToolPaths(binaries=binaries, kwok_stages=stages, argocd_crds=argocd_crds,
                     versions=versions)


def build(src: Path | None = None, *, log: bool = True) -> ToolPaths:
    """Build every tool whose cache folder is absent; idempotent and safe to rerun."""
    src = src or tools_src_dir()
    go = shutil.which("go") or next(
        (p for p in ("/usr/local/go/bin/go",) if os.access(p, os.X_OK)), None
    )
    for tool in TOOLS:
        folder = tool_dir(src, tool)
        if all(os.access(folder / "bin" / b, os.X_OK) for b in tool.binaries):
            _say(log, f"[tools] {tool.name}: cached at {folder}")
            continue
        # A binary added to a tool since its folder was built: rebuild that tool only.
        shutil.rmtree(folder, ignore_errors=True)
        if go is None:
            raise ToolsMissingError(
                f"{tool.name} is not cached at {folder} and `go` is not on PATH"
            )
        _build_one(go, src, tool, folder, log)
    return locate(src)


def _build_one(go: str, src: Path, tool: Tool, folder: Path, log: bool) -> None:
    version = pinned_version(src, tool)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Build into a sibling temp dir and rename: a half-built tool never looks cached.
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    staging.chmod(0o755)
    log_path = staging / "build.log"
    cmd = [
        go,
        "build",
        "-p",
        os.environ.get("KVFLEET_GO_BUILD_JOBS", "2"),
        "-trimpath",
        *(["-tags", ",".join(tool.tags)] if tool.tags else []),
        "-ldflags",
        tool.ldflags(version),
        "-o",
        str(staging / "bin") + "/",
        *tool.packages,
    ]
    env = {**os.environ, "CGO_ENABLED": "0"}
    _say(log, f"[tools] {tool.name} {version}: building (log {log_path})")
    started = time.monotonic()
    done = threading.Event()
    ticker = threading.Thread(target=_tick, args=(log, tool.name, started, done), daemon=True)
    ticker.start()
    try:
        with log_path.open("wb") as out:
            # Niced so a cold build on a shared 2-core box leaves room for everyone's tests.
            rc = subprocess.call(
                cmd,
                cwd=src / tool.name,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.nice(10),
            )
    finally:
        done.set()
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        shutil.rmtree(staging, ignore_errors=True)
        raise ToolsMissingError(f"building {tool.name} {version} failed (exit {rc}):\n{tail}")
    if tool.name == "kwok":
        _copy_module_files(go, src / tool.name, tool.module_path, KWOK_STAGE_FILES,
                           staging / KWOK_STAGES_NAME)
    if tool.name == "argocd":
        _copy_module_files(go, src / tool.name, tool.module_path, ARGOCD_CRD_FILES,
                           staging / ARGOCD_CRDS_NAME)
    staging.rename(folder)
    _say(log, f"[tools] {tool.name}: built in {time.monotonic() - started:.0f}s -> {folder}")


def _copy_module_files(go: str, module_dir: Path, module: str, files: tuple[str, ...],
                       out: Path) -> None:
    """YAML files of the pinned `module`, joined into one multi-document file beside its
    binaries."""
    source = subprocess.check_output(
        [go, "list", "-m", "-f", "{{.Dir}}", module], cwd=module_dir, text=True
    ).strip()
    docs = [(Path(source) / rel).read_text().strip() for rel in files]
    out.write_text("\n---\n".join(docs) + "\n")


def _tick(log: bool, name: str, started: float, done: threading.Event) -> None:
    while not done.wait(60):
        _say(log, f"[tools] {name}: still building ({(time.monotonic() - started) / 60:.0f} min)")


def _say(log: bool, message: str) -> None:
    if log:
        print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="only report whether all are built")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        paths = locate() if args.check else build()
    except ToolsMissingError as exc:
        print(f"[tools] {exc}", file=sys.stderr)
        return 1
    for name, version in paths.versions.items():
        print(f"[tools] {name} {version}")
    print(f"[tools] ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
