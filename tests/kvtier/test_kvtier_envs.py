"""One home per setting: the product packages read L2FS_* / KVTIER_* environment variables only in l2fs/envs.py
and kvtier/envs.py (a lint over their source), every name they ask those modules for is in a table, and the
defaults the tables hold are what the programs' own parsers get."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from kvtier import envs as kvtier_envs
from l2fs import envs as l2fs_envs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("l2fs", "connector", "router", "operator_patch", "kvtier")
HOMES = {"l2fs/envs.py", "kvtier/envs.py"}
PREFIXES = ("L2FS_", "KVTIER_")


def _sources() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if "/proto/" not in rel and rel not in HOMES:
                out[rel] = p.read_text()
    return out


def _constants(sources: dict[str, str]) -> dict[str, str]:
    """Module-level NAME = "L2FS_..."/"KVTIER_..." strings of every module (e.g. connector.config.PREFILL_ENV):
    a read through such a name is a read of that variable."""
    consts: dict[str, str] = {}
    for src in sources.values():
        for node in ast.parse(src).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and node.value.value.startswith(PREFIXES):
                consts.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return consts


def _env_name(node: ast.expr, consts: dict[str, str]) -> str | None:
    """The variable a key expression names when it is one of ours (a literal, a constant, "KVTIER_" + ...)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if node.value.startswith(PREFIXES) else None
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.JoinedStr) and node.values:
        return _env_name(node.values[0], consts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _env_name(node.left, consts)
    return None


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def env_reads(src: str, consts: dict[str, str]) -> list[tuple[int, str]]:
    """(line, variable) of every read of one of our variables from the process environment in `src`."""
    found = []
    for node in ast.walk(ast.parse(src)):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault") and _is_environ(f.value):
                key = node.args[0]
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            key = node.left
        name = _env_name(key, consts) if key is not None else None
        if name:
            found.append((node.lineno, name))
    return found


def test_lint_finds_each_kind_of_read() -> None:
    """The check itself can fail: each way of reading the environment is found, writes are not."""
    src = ('import os\nfrom os import environ, getenv\nNAME = "KVTIER_X"\n'
           'a = os.environ.get("L2FS_MASTER")\nb = os.getenv(NAME)\nc = "KVTIER_Y" in os.environ\n'
           'd = environ["L2FS_TOKEN"]\ne = getenv(f"KVTIER_{NAME}")\nf = os.environ.get("KVTIER_" + NAME)\n'
           'os.environ["L2FS_TOKEN"] = "t"\ng = os.environ.get("HOME")\n')
    reads = env_reads(src, _constants({"x": src}))
    assert [line for line, _ in reads] == [4, 5, 6, 7, 8, 9]


def test_environment_is_read_only_in_the_envs_modules() -> None:
    sources = _sources()
    consts = _constants(sources)
    bad = [f"{path}:{line}: {name}" for path, src in sources.items() for line, name in env_reads(src, consts)]
    assert not bad, ("read these through l2fs.envs (L2FS_*) or kvtier.envs (KVTIER_*), adding them to its "
                     "table:\n" + "\n".join(bad))


def test_every_name_asked_for_is_in_a_table() -> None:
    """envs.get(NAME) of a name missing from the table is a KeyError at run time: find them all now."""
    sources = _sources()
    consts = _constants(sources)
    tables = {**l2fs_envs.VARS, **kvtier_envs.VARS}
    asked = set()
    for src in sources.values():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id.endswith("envs") and node.args:
                name = _env_name(node.args[0], consts)
                assert name, f"envs.get with a key the check cannot read: {ast.unparse(node)}"
                asked.add(name)
    assert asked - set(tables) == set()
    assert {"L2FS_MASTER", "L2FS_TOKEN", "KVTIER_ROUTER_WORKERS", "KVTIER_PREFILL_TOKENS_PER_S"} <= asked
    assert all(v.meaning for v in tables.values())


def test_router_parser_defaults_come_from_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.cli import build_parser

    monkeypatch.delenv("KVTIER_ROUTER_WORKERS", raising=False)
    assert build_parser().parse_args([]).workers == int(kvtier_envs.VARS["KVTIER_ROUTER_WORKERS"].default or 0) == 1
    monkeypatch.setenv("KVTIER_ROUTER_WORKERS", "3")
    monkeypatch.setenv("KVTIER_ROUTER_PREFIX_AFFINITY", "1")
    ns = build_parser().parse_args([])
    assert (ns.workers, ns.prefix_affinity) == (3, True)


def test_operator_flags_keep_an_empty_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVTIER_<FLAG> feeds every webhook/operator-patch flag; '' is a value there ('' = no token Secret)."""
    from operator_patch.options import add_config_args

    def parse() -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_config_args(p)
        return p.parse_args([])

    monkeypatch.delenv("KVTIER_TOKEN_SECRET", raising=False)
    default = parse().token_secret
    assert default  # PatchConfig's default names a Secret
    monkeypatch.setenv("KVTIER_TOKEN_SECRET", "")
    assert parse().token_secret == ""
    monkeypatch.setenv("KVTIER_MASTER", "m:1")
    assert parse().master == "m:1"


def _patch_flag_vars() -> set[str]:
    """KVTIER_<FLAG> of every `kvtier webhook` / `operator-patch` flag: kvtier/envs.py's PATCH_FLAG family row."""
    from operator_patch.options import add_config_args

    p = argparse.ArgumentParser()
    add_config_args(p)
    return {"KVTIER_" + a.option_strings[0].lstrip("-").replace("-", "_").upper()
            for a in p._actions if a.option_strings and a.dest != "help"}


def _deploy_config() -> tuple[dict[str, str], dict[str, set[str]]]:
    """deploy/'s kvtier-config ConfigMap: the keys and values of deploy/base/config.env, and every key of it
    that deploy/ sets (config.env, the overlays' and components' merges) -> the files that set it."""
    import yaml

    base = {}
    for line in (ROOT / "deploy/base/config.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            base[key.strip()] = value.strip()
    where: dict[str, set[str]] = {}
    for kust in sorted((ROOT / "deploy").rglob("kustomization.yaml")):
        for gen in yaml.safe_load(kust.read_text()).get("configMapGenerator") or []:
            if gen.get("name") != "kvtier-config":
                continue
            for lit in gen.get("literals") or []:
                where.setdefault(lit.split("=", 1)[0], set()).add(kust.relative_to(ROOT).as_posix())
            for env in gen.get("envs") or []:
                assert (kust.parent / env).resolve() == ROOT / "deploy/base/config.env", (kust, env)
                for key in base:
                    where.setdefault(key, set()).add("deploy/base/config.env")
    return base, where


def test_every_deploy_config_key_has_one_home() -> None:
    """Each key deploy/ puts in kvtier-config is documented in exactly one table: l2fs/envs.py's (a program reads
    it), kvtier/envs.py's VARS or its KVTIER_<FLAG> family (the webhook reads it), or kvtier/envs.py's DEPLOY (only
    the manifests expand it)."""
    base, where = _deploy_config()
    assert "L2FS_DATA_CAPACITY" in base and "deploy/overlays/dev/kustomization.yaml" in where["L2FS_DATA_CAPACITY"]
    assert set(base) <= set(where)  # config.env is the generator's file
    flags = _patch_flag_vars()
    assert {"KVTIER_MODE", "KVTIER_TOKEN_SECRET"} <= flags
    tables = {"l2fs/envs.py VARS": set(l2fs_envs.VARS), "kvtier/envs.py VARS": set(kvtier_envs.VARS),
              "kvtier/envs.py PATCH_FLAG": flags, "kvtier/envs.py DEPLOY": set(kvtier_envs.DEPLOY)}
    bad = []
    for key in sorted(where):
        homes = [t for t, names in tables.items() if key in names]
        if len(homes) != 1:
            bad.append(f"{key} (set in {', '.join(sorted(where[key]))}): in {homes or 'no table'}")
    assert not bad, "each kvtier-config key needs exactly one row (a DEPLOY row if only manifests read it):\n" + \
        "\n".join(bad)


def test_deploy_table_has_no_stale_rows() -> None:
    """Every DEPLOY row is a key of deploy/base/config.env with the value config.env gives it, and has a meaning."""
    base, _ = _deploy_config()
    assert set(kvtier_envs.DEPLOY) - set(base) == set(), "DEPLOY rows no longer in deploy/base/config.env"
    assert {k: v.default for k, v in kvtier_envs.DEPLOY.items()} == {k: base[k] for k in kvtier_envs.DEPLOY}
    assert all(v.meaning for v in kvtier_envs.DEPLOY.values())
