"""Pure patch logic: turn an operator-rendered Deployment into one that uses l2fs as LMCache's L2.

Everything here works on plain dicts (the JSON the API server / AdmissionReview carries) and has no
I/O, so the webhook, the CLI and the tests share one implementation. The rendered shape varies by
operator version (LMCACHE_REMOTE_URL present, absent, duplicated, user entries stripped), so nothing
here relies on list indices; all edits are in place by name, which keeps a second pass a no-op.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from kvtier import contract

OPT_IN_KEY = "kvtier.io/l2fs"  # label or annotation on the Deployment; value "enabled" or "true"
CONTAINER_KEY = "kvtier.io/container"  # optional annotation: which container runs vLLM
SNAPSHOT_KEY = "kvtier.io/original"  # CLI: pre-patch copy of what we change, for `revert`
PATCHED_KEY = "kvtier.io/patched"  # fingerprint of the PatchConfig that was applied
ENDPOINT_LABEL = "kvtier.io/endpoint"  # pod label the kvtier router selects on
STRATEGY_KEY = "kvtier.io/router-strategy"  # pod annotation: records the strategy (routers take it from their flag)
# model revision: set by hand on the IEC (or the Deployment) to override; recorded on the patched pod template
REVISION_KEY = "kvtier.io/model-revision"
KV_PREFIX_KEY = "kvtier.io/kv-prefix"  # pod annotation: the l2fs directory this endpoint revision writes
# tenant isolation: name of a Secret (in the endpoint's namespace, keys "salt" and "dir", see
# `kvtier lmcache-config salt-secret`) on the IEC or Deployment; recorded on the patched pod template
KV_SALT_SECRET_KEY = "kvtier.io/kv-salt-secret"
# scoped credentials: name of a Secret (endpoint's namespace, key `token_key`) with this endpoint's engine-role
# l2fs token, on the IEC or Deployment; default PatchConfig.token_secret; recorded on the patched pod template
TOKEN_SECRET_KEY = "kvtier.io/l2fs-token-secret"
SALT_DIR_VAR = "KVTIER_KV_SALT_DIR"  # env from the Secret's "dir", expanded by kubelet into the chunk directory
SALT_VOLUME = "kvtier-kv-salt"
SALT_MOUNT_PATH = "/etc/kvtier/kv-salt"
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
UNVERSIONED = "unversioned"  # no IEC and no annotation: still one namespace per endpoint
IEC_GROUP = "inference.sagemaker.aws.amazon.com"
IEC_KIND = "InferenceEndpointConfig"
IEC_PLURAL = "inferenceendpointconfigs"
ROUTER_FLAG = "--routing-logic"  # vLLM production-stack router flag the HyperPod router uses
ROUTER_STRATEGIES = contract.STRATEGIES
URL_VAR = "LMCACHE_REMOTE_URL"
PLUGINS_VAR = "LMCACHE_REMOTE_STORAGE_PLUGINS"  # comma-separated plugin names (LMCache's env list form)
TOKEN_VAR = "L2FS_TOKEN"  # the l2fs client (connector.lmcache_l2fs) reads its bearer token from here
KV_TRANSFER_FLAG = "--kv-transfer-config"
KV_EVENTS_FLAG = "--kv-events-config"
# Container port names the webhook adds and the router resolves (kvtier router --k8s-kv-events-port ...)
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"
FAILURE_POLICIES = ("recompute", "fail", "")


class PatchError(ValueError):
    """The object cannot be patched as asked (e.g. no vLLM container); nothing was changed."""


class Refused(PatchError):
    """The endpoint would hold a worker or admin l2fs credential (a Secret in `privileged_secrets`): the
    webhook denies the object instead of admitting it (docs/deploy.md, Tokens)."""


@dataclass(frozen=True)
class PatchConfig:
    """What "use l2fs as L2" means for one cluster. Defaults match deploy/base."""

    mode: Literal["mount", "plugin", "mp"] = "mount"
    mount_path: str = "/mnt/l2fs"  # where pods see the FUSE mount
    # l2fs directory of the KV chunks, shared by both modes (= connector.config.DEFAULT_PREFIX and the
    # router's --l2fs-prefix), so mount-mode and plugin-mode pods and the router see the same chunks
    prefix: str = contract.KV_PREFIX
    # the node path the l2fs-mount DaemonSet mounts under: endpoint E's FUSE mount at <host_path>/E/E, the pods of
    # E given the plain directory <host_path>/E (endpoint_mount)
    host_path: str = "/mnt/l2fs"
    pvc_name: str = ""  # use a PVC instead of the hostPath (e.g. a CSI RWX volume)
    volume_name: str = "kvtier-l2fs"
    serde: str = "naive"  # cachegen serde breaks under fs (zip bug); naive is safe
    hash_seed: str = contract.HASH_SEED  # LMCache's builtin chunk hash needs the same seed in every pod
    router_strategy: str = contract.DEFAULT_STRATEGY
    plugin_name: str = contract.PLUGIN_NAME
    plugin_module: str = contract.PLUGIN_MODULE
    plugin_class: str = contract.PLUGIN_CLASS
    master: str = "l2fs-master.kvtier.svc.cluster.local:8995"
    data_path: str = "/run/l2fs"  # plugin mode: the workers' fd-passing socket dir, mounted for short-circuit I/O
    node_env: str = "L2FS_NODE_ID"  # plugin mode: env the plugin reads its node id from (local-first)
    # vLLM's kv_transfer_config.kv_load_failure_policy (vLLM >= 0.11.1; its default "fail" turns a lost or
    # corrupt L2 chunk into a failed request; "recompute" makes it a miss). "" leaves the operator's value.
    kv_load_failure_policy: str = "recompute"
    # plugin mode: Secret (in the workload namespace) holding the endpoint's engine-role l2fs token, read into
    # L2FS_TOKEN; "{endpoint}" is replaced by the endpoint (IEC) name, annotation kvtier.io/l2fs-token-secret
    # overrides; "" = no token (insecure dev clusters only). Mount mode needs none: the mount pod holds it.
    token_secret: str = "{endpoint}-l2fs-token"
    token_key: str = "token"
    # Secrets holding worker/admin credentials (the tokens file, the mount's admin token, the old shared
    # token): an endpoint Deployment that would get one (token_secret or any reference) is refused
    privileged_secrets: str = "l2fs-tokens,l2fs-mount-token,l2fs-token,l2fs-endpoint-mounts"
    # vLLM KV events for the kvtier router: ZMQ PUB + replay ports, exposed as named container ports
    # (kv-events / kv-replay); 0 = do not add --kv-events-config
    kv_events_port: int = 5557
    kv_replay_port: int = 5558
    # LMCache dtype of the KV when the vLLM args do not name one (--dtype/--kv-cache-dtype auto or absent: vLLM
    # takes the model's torch_dtype, bfloat16 for most current models); annotation kvtier.io/kv-dtype on the
    # IEC or Deployment overrides. Recorded on the pod (kvtier.io/kv-dtype) for the router's L2 lookups.
    kv_dtype: str = "bfloat16"
    # mp mode (LMCache multiprocess): an `lmcache server` native sidecar (initContainer, restartPolicy Always) in
    # each engine pod with kvtier's L2 adapter, on loopback port mp_port, mp_l1_gb of host memory as its L1;
    # vLLM gets LMCache's MP connector in engine_driven transfer mode (no CUDA IPC into the sidecar, so the
    # sidecar needs no GPU, no hostIPC and no hostPath: Pod Security baseline). mp_image "" = the vLLM image.
    mp_port: int = 6555
    # the server's HTTP admin API (LMCache's default is 8080, the port HyperPod's vLLM serves on: in one pod the
    # two would collide), also on loopback only: it has no authentication
    mp_http_port: int = 6556
    mp_l1_gb: float = 4.0
    mp_image: str = ""
    # an InferenceEndpointConfig with l2CacheBackend "tieredstorage" is taken over only when opted in
    # (label/annotation kvtier.io/l2fs on it or its Deployment); "redis" and L2-disabled ones never are

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.plugin_name):
            raise ValueError(f"plugin_name must be one plain name (LMCache splits its env list on ','), "
                             f"not {self.plugin_name!r}")
        if self.mode not in ("mount", "plugin", "mp"):
            raise ValueError(f"mode must be 'mount', 'plugin' or 'mp', not {self.mode!r}")
        object.__setattr__(self, "mp_port", int(self.mp_port))
        object.__setattr__(self, "mp_http_port", int(self.mp_http_port))
        object.__setattr__(self, "mp_l1_gb", float(self.mp_l1_gb))
        if not 0 < self.mp_port < 65536 or not 0 < self.mp_http_port < 65536 or self.mp_l1_gb <= 0:
            raise ValueError(f"mp_port and mp_http_port must be ports and mp_l1_gb positive, not "
                             f"{self.mp_port}/{self.mp_http_port}/{self.mp_l1_gb}")
        for name in ("mount_path", "host_path", "data_path"):
            value = getattr(self, name)
            if name == "data_path" and value == "":
                continue  # short-circuit I/O off
            if not value.startswith("/") or "," in value or " " in value:
                raise ValueError(f"{name} must be an absolute path without ',' or spaces, not {value!r}")
        if not self.prefix.startswith("/") or not self.prefix.strip("/") or "," in self.prefix or " " in self.prefix \
                or ".." in self.prefix.split("/"):
            raise ValueError(f"prefix must be an absolute l2fs directory like /kvtier/kv, not {self.prefix!r}")
        if self.router_strategy not in ROUTER_STRATEGIES:
            raise ValueError(f"router_strategy must be one of {ROUTER_STRATEGIES}, not {self.router_strategy!r}")
        if not self.hash_seed.isdigit():
            raise ValueError(f"hash_seed must be a non-negative integer, not {self.hash_seed!r}")
        if ":" not in self.master:
            raise ValueError(f"master must be HOST:PORT, not {self.master!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}, "
                             f"not {self.kv_load_failure_policy!r}")
        for name in ("kv_events_port", "kv_replay_port"):
            port = int(getattr(self, name))
            if not 0 <= port < 65536:
                raise ValueError(f"{name} must be a port number (0 = off), not {port}")
            object.__setattr__(self, name, port)  # flags/env arrive as strings
        if self.kv_dtype not in contract.LMCACHE_DTYPES:
            raise ValueError(f"kv_dtype must be one of {contract.LMCACHE_DTYPES} (LMCache's names), "
                             f"not {self.kv_dtype!r}")
        if self.kv_events_port and self.kv_events_port == self.kv_replay_port:
            raise ValueError("kv_events_port and kv_replay_port must differ")
        if self.mode == "mp":  # one pod, one network namespace: the sidecar's ports and vLLM's added ones
            ports = [p for p in (self.mp_port, self.mp_http_port, self.kv_events_port, self.kv_replay_port) if p]
            if len(set(ports)) != len(ports):
                raise ValueError(f"mp_port, mp_http_port, kv_events_port and kv_replay_port must differ, not {ports}")

    @property
    def remote_url(self) -> str:
        """LMCache fs:// URL of the base prefix (see url_for: pods get their revision's directory)."""
        return self.url_for(self.prefix)

    def url_for(self, prefix: str) -> str:
        """LMCache fs:// URL of an l2fs directory; host and port are placeholders its URL parser insists on."""
        return f"fs://localhost:0{self.mount_path.rstrip('/')}/{prefix.strip('/')}/"

    def fingerprint(self) -> str:
        """Short stable hash, stored on patched objects so `verify` can tell config drift."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


# ---------------------------------------------------------------- selection


def _meta(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("metadata") or {}


def owner_endpoint(obj: dict[str, Any]) -> str | None:
    """Name of the InferenceEndpointConfig that owns `obj`, if any."""
    for ref in _meta(obj).get("ownerReferences") or []:
        if ref.get("kind") == IEC_KIND and str(ref.get("apiVersion", "")).startswith(IEC_GROUP + "/"):
            return ref.get("name")
    return None


def iec_revision(iec: dict[str, Any]) -> str:
    """Model revision of an endpoint from its InferenceEndpointConfig: kvtier.contract.iec_revision (shared with
    `kvtier lmcache-config --iec`, so a hand-configured pod files its chunks where patched pods do)."""
    return contract.iec_revision(iec)


def model_revision(dep: dict[str, Any], iec: dict[str, Any] | None = None) -> str:
    """The revision a patched pod's chunks are filed under: the IEC's (iec_revision), else the Deployment's
    annotation, else the one recorded on its pod template by an earlier patch, else "unversioned"."""
    if iec is not None:
        return iec_revision(iec)
    for meta in (_meta(dep), ((dep.get("spec") or {}).get("template") or {}).get("metadata") or {}):
        value = str((meta.get("annotations") or {}).get(REVISION_KEY) or "").strip()
        if value:
            return value
    return UNVERSIONED


def endpoint_prefix(dep: dict[str, Any], cfg: PatchConfig, iec: dict[str, Any] | None = None) -> tuple[str, str]:
    """(revision, l2fs directory) of this endpoint's chunks: <cfg.prefix>/<endpoint>/<revision>.

    Why: every endpoint serves /opt/ml/model, LMCache's model name, so only the directory keeps two
    endpoints, or two weight versions of one, from loading each other's KV."""
    endpoint = owner_endpoint(dep) or _meta(dep).get("name") or "deployment"
    revision = model_revision(dep, iec)
    return revision, contract.revision_prefix(cfg.prefix, endpoint, revision)


def _annotated_secret(key: str, dep: dict[str, Any], iec: dict[str, Any] | None,
                      old: dict[str, Any] | None) -> str:
    """A Secret name from annotation `key`: the Deployment's, else the IEC's when it was read (authoritative
    then), else the one recorded on the pod template by an earlier patch, in this object or in `old`."""
    def template_meta(obj: dict[str, Any] | None) -> dict[str, Any]:
        return (((obj or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}

    sources = [_meta(dep)] + ([_meta(iec)] if iec is not None else [template_meta(dep), template_meta(old)])
    for meta in sources:
        name = str((meta.get("annotations") or {}).get(key) or "").strip()
        if name:
            _check_secret_name(f"annotation {key}", name)
            return name
    return ""


def _check_secret_name(what: str, name: str) -> None:
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise PatchError(f"{what}={name!r} is not a Secret name")


def salt_secret(dep: dict[str, Any], iec: dict[str, Any] | None = None, old: dict[str, Any] | None = None) -> str:
    """Name of the endpoint's KV-salt Secret ("" = unsalted): the Deployment's annotation, else the IEC's
    when it was read (it is authoritative then: removing it there unsalts the next rendering), else the one
    recorded on the pod template by an earlier patch, in this object or in `old` (the object an UPDATE
    replaces): an operator re-render while the IEC cannot be read stays salted instead of failing open."""
    return _annotated_secret(KV_SALT_SECRET_KEY, dep, iec, old)


def token_secret(dep: dict[str, Any], cfg: PatchConfig, iec: dict[str, Any] | None = None,
                 old: dict[str, Any] | None = None) -> str:
    """Plugin mode: the Secret with this endpoint's engine-role l2fs token ("" = no token, insecure config):
    annotation kvtier.io/l2fs-token-secret (Deployment, IEC, recorded), else cfg.token_secret with
    {endpoint} replaced. Per endpoint because an engine token may write only under its endpoint's prefix."""
    if not cfg.token_secret:
        return ""
    name = _annotated_secret(TOKEN_SECRET_KEY, dep, iec, old)
    if not name:
        endpoint = owner_endpoint(dep) or _meta(dep).get("name") or "deployment"
        name = cfg.token_secret.replace("{endpoint}", endpoint)
        _check_secret_name("token secret", name)
    return name


def _secret_refs(dep: dict[str, Any]) -> set[str]:
    """Every Secret the pod template references (env, envFrom, volumes, projected volumes)."""
    spec = ((dep.get("spec") or {}).get("template") or {}).get("spec") or {}
    names: set[str] = set()
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for e in c.get("env") or []:
            names.add(str((((e.get("valueFrom") or {}).get("secretKeyRef")) or {}).get("name") or ""))
        for e in c.get("envFrom") or []:
            names.add(str((e.get("secretRef") or {}).get("name") or ""))
    for v in spec.get("volumes") or []:
        names.add(str((v.get("secret") or {}).get("secretName") or ""))
        for src in (v.get("projected") or {}).get("sources") or []:
            names.add(str((src.get("secret") or {}).get("name") or ""))
    names.discard("")
    return names


def refuse_privileged(dep: dict[str, Any], cfg: PatchConfig) -> None:
    """Refused when the (patched) endpoint pod would hold a worker/admin credential: an engine pod with one
    could register as a worker, delete or overwrite any chunk of any endpoint."""
    bad = {s.strip() for s in cfg.privileged_secrets.split(",") if s.strip()} & _secret_refs(dep)
    if bad:
        raise Refused(f"the pod would get Secret(s) {sorted(bad)}, which hold l2fs worker/admin credentials; an "
                      f"endpoint gets its own engine-role token (kvtier tokens generate --engine; annotation "
                      f"{TOKEN_SECRET_KEY}); docs/deploy.md, Tokens")


def chunk_dir(kv_prefix: str, secret: str) -> str:
    """The directory patched pods write: the revision prefix, plus the salt directory when salted (kubelet
    expands $(KVTIER_KV_SALT_DIR) from the Secret: the pod spec never holds the salt or the name)."""
    return f"{kv_prefix.rstrip('/')}/$({SALT_DIR_VAR})" if secret else kv_prefix


def opted_in(obj: dict[str, Any]) -> bool:
    """True when the Deployment carries the opt-in label or annotation."""
    meta = _meta(obj)
    for source in (meta.get("labels") or {}, meta.get("annotations") or {}):
        if str(source.get(OPT_IN_KEY, "")).lower() in ("enabled", "true"):
            return True
    return False


def l2_choice(iec: dict[str, Any]) -> tuple[bool, str]:
    """(may kvtier provide this endpoint's L2, why) from the InferenceEndpointConfig's own L2 setting.

    The IEC is the user's statement of intent: an endpoint without L2 stays without it, a Redis L2 stays
    Redis; only "tieredstorage" (the CRD cannot name an fs L2, so it is the placeholder) is taken over."""
    kv = (iec.get("spec") or {}).get("kvCacheSpec") or {}
    if kv.get("enableL2Cache") is not True:
        return False, "its InferenceEndpointConfig has L2 disabled (kvCacheSpec.enableL2Cache is not true)"
    backend = str((kv.get("l2CacheSpec") or {}).get("l2CacheBackend") or "tieredstorage").lower()
    if backend != "tieredstorage":
        return False, f"its InferenceEndpointConfig chose l2CacheBackend {backend!r}"
    return True, "l2CacheBackend tieredstorage"


def _rendered_l2_is_redis(dep: dict[str, Any]) -> bool:
    """Without the IEC: the operator rendered a Redis L2 URL (the endpoint chose Redis)."""
    try:
        containers = _containers(dep)
    except PatchError:
        return False
    return any(str(e.get("value") or "").startswith(("redis://", "rediss://"))
               for c in containers for e in c.get("env") or [] if e.get("name") == URL_VAR)


def _containers(dep: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        containers = dep["spec"]["template"]["spec"]["containers"]
    except (KeyError, TypeError):
        raise PatchError("object has no spec.template.spec.containers; is it a Deployment?") from None
    if not isinstance(containers, list) or not containers:
        raise PatchError("spec.template.spec.containers is empty")
    return containers


def _has_flag(container: dict[str, Any], flag: str) -> bool:
    words = [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]
    return any(w == flag or w.startswith(flag + "=") or f" {flag} " in f" {w} " for w in words)


def is_router(dep: dict[str, Any]) -> bool:
    """A production-stack style router Deployment (has a --routing-logic flag)."""
    try:
        return any(_has_flag(c, ROUTER_FLAG) for c in _containers(dep))
    except PatchError:
        return False


def select_container(dep: dict[str, Any]) -> int:
    """Index of the vLLM container: the annotated one, else the one named after the Deployment,
    else the one running LMCache (LMCACHE_* env or a --kv-transfer-config arg)."""
    containers = _containers(dep)
    names = [c.get("name") for c in containers]
    wanted = (_meta(dep).get("annotations") or {}).get(CONTAINER_KEY)
    if wanted:
        if wanted not in names:
            raise PatchError(f"annotation {CONTAINER_KEY}={wanted!r} names no container (have {names})")
        return names.index(wanted)
    name = _meta(dep).get("name")
    if name in names:
        return names.index(name)
    for i, c in enumerate(containers):
        if any(str(e.get("name", "")).startswith("LMCACHE_") for e in c.get("env") or []):
            return i
        if _has_flag(c, "--kv-transfer-config"):
            return i
    raise PatchError(
        f"no vLLM container in Deployment {name!r}: none is named after it, none has LMCACHE_* env or "
        f"--kv-transfer-config (containers: {names}); set annotation {CONTAINER_KEY}"
    )


# ---------------------------------------------------------------- edits


def _set_env(env: list[dict[str, Any]], name: str, value: str | None = None,
             value_from: dict[str, Any] | None = None) -> None:
    """Exactly one entry `name`, kept at the position of its first occurrence (or appended)."""
    entry: dict[str, Any] = {"name": name}
    if value_from is not None:
        entry["valueFrom"] = value_from
    else:
        entry["value"] = value
    idx = [i for i, e in enumerate(env) if e.get("name") == name]
    for i in reversed(idx[1:]):
        del env[i]
    if idx:
        env[idx[0]] = entry
    else:
        env.append(entry)


def _drop_env(env: list[dict[str, Any]], name: str) -> None:
    env[:] = [e for e in env if e.get("name") != name]


def _env_value(env: list[dict[str, Any]], name: str) -> str | None:
    for e in env:
        if e.get("name") == name:
            return e.get("value")
    return None


def _upsert(items: list[dict[str, Any]], new: dict[str, Any], same: Any) -> None:
    """Replace the first item `same(item)` says matches, drop other matches, else append."""
    idx = [i for i, it in enumerate(items) if same(it)]
    for i in reversed(idx[1:]):
        del items[i]
    if idx:
        items[idx[0]] = new
    else:
        items.append(new)


def _set_flag(words: list[str], flag: str, value: str) -> bool:
    """Set `--flag value` / `--flag=value` in an argv list in place; False when the flag is absent."""
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            words[i + 1] = value
            return True
        if w.startswith(flag + "="):
            words[i] = f"{flag}={value}"
            return True
    return False


def _extra_config(env: list[dict[str, Any]], cfg: PatchConfig, kv_prefix: str, revision: str) -> str:
    """LMCACHE_EXTRA_CONFIG with the plugin keys merged over whatever the operator put there."""
    raw = _env_value(env, "LMCACHE_EXTRA_CONFIG")
    try:
        extra = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        extra = {}
    if not isinstance(extra, dict):
        extra = {}
    prefix = f"remote_storage_plugin.{cfg.plugin_name}."
    extra.update({
        prefix + "module_path": cfg.plugin_module,
        prefix + "class_name": cfg.plugin_class,
        prefix + "master": cfg.master,
        prefix + "prefix": kv_prefix,
        prefix + "model_revision": revision,  # recorded in the connector's key-compat fingerprint
    })
    return json.dumps(extra, sort_keys=True, separators=(",", ":"))


def _flag_value(words: list[Any], flag: str) -> str | None:
    for i, w in enumerate(words):
        w = str(w)
        if w == flag and i + 1 < len(words):
            return str(words[i + 1])
        if w.startswith(flag + "="):
            return w[len(flag) + 1:]
    return None


def _argv(c: dict[str, Any]) -> list[Any] | None:
    """The list vLLM's flags go in: args, or command when the container has only a command. None when it
    has neither: adding args would replace the image's CMD, whatever it holds."""
    for key in ("args", "command"):
        if isinstance(c.get(key), list) and c[key]:
            return c[key]
    return None


def _json_flag(c: dict[str, Any], flag: str) -> dict[str, Any] | None:
    """The JSON object a flag carries (in args or command), None when absent or not a JSON object."""
    for key in ("args", "command"):
        words = c.get(key)
        if isinstance(words, list) and (raw := _flag_value(words, flag)) is not None:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


def _put_json_flag(c: dict[str, Any], flag: str, value: dict[str, Any]) -> None:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    for key in ("args", "command"):
        words = c.get(key)
        if isinstance(words, list) and _set_flag(words, flag, text):
            return
    argv = _argv(c)
    if argv is not None:
        argv.extend([flag, text])


def kv_events_config(cfg: PatchConfig) -> dict[str, Any]:
    """vLLM --kv-events-config: ZMQ PUB (+ replay) bound on every pod interface, for the kvtier router."""
    out: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq",
                           "endpoint": f"tcp://*:{cfg.kv_events_port}"}
    if cfg.kv_replay_port:
        out["replay_endpoint"] = f"tcp://*:{cfg.kv_replay_port}"
    return out


def _named_ports(cfg: PatchConfig) -> list[dict[str, Any]]:
    ports = [{"name": KV_EVENTS_PORT_NAME, "containerPort": cfg.kv_events_port, "protocol": "TCP"}]
    if cfg.kv_replay_port:
        ports.append({"name": KV_REPLAY_PORT_NAME, "containerPort": cfg.kv_replay_port, "protocol": "TCP"})
    return ports


def _patch_vllm_flags(c: dict[str, Any], cfg: PatchConfig) -> None:
    """kv_load_failure_policy into the operator's --kv-transfer-config; --kv-events-config + named ports."""
    if cfg.kv_load_failure_policy:
        transfer = _json_flag(c, KV_TRANSFER_FLAG)
        if transfer is not None:  # absent: LMCache is not wired into this vLLM at all; nothing to recompute
            transfer["kv_load_failure_policy"] = cfg.kv_load_failure_policy
            _put_json_flag(c, KV_TRANSFER_FLAG, transfer)
    if cfg.kv_events_port and _argv(c) is not None:
        events = _json_flag(c, KV_EVENTS_FLAG) or {}
        events.update(kv_events_config(cfg))
        _put_json_flag(c, KV_EVENTS_FLAG, events)
        ports: list[dict[str, Any]] = c.setdefault("ports", [])
        for port in _named_ports(cfg):
            _upsert(ports, port, lambda p, port=port: p.get("name") == port["name"]
                    or p.get("containerPort") == port["containerPort"])


def kv_layout(dep: dict[str, Any], c: dict[str, Any], cfg: PatchConfig,
              iec: dict[str, Any] | None = None) -> tuple[str, int]:
    """(LMCache dtype, world size) of the chunk keys the vLLM container will write, from its flags: world
    size = --tensor-parallel-size x --pipeline-parallel-size; dtype = --kv-cache-dtype, else --dtype, else the
    kvtier.io/kv-dtype annotation (Deployment, IEC), else cfg.kv_dtype. The router needs both to find the
    endpoint's chunks (they are part of LMCache's key)."""
    words = [str(w) for w in (c.get("command") or []) + (c.get("args") or [])]

    def flag(*names: str) -> str | None:
        for name in names:
            for spelled in (name, name.replace("-", "_")):
                value = _flag_value(words, spelled)
                if value is not None:
                    return value
        return None

    def size(*names: str) -> int:
        raw = flag(*names) or "1"
        if not raw.isdigit() or int(raw) < 1:
            raise PatchError(f"{names[0]}={raw!r} is not a positive integer")
        return int(raw)

    world = size("--tensor-parallel-size", "-tp") * size("--pipeline-parallel-size", "-pp")
    dtype = None
    for value in (flag("--kv-cache-dtype"), flag("--dtype")):
        if value and value != "auto":
            dtype = contract.VLLM_TO_LMCACHE_DTYPE.get(value)
            break  # fp8 caches and other names: not mapped, fall back to the annotation/default below
    if dtype is None:
        for meta in (_meta(dep), _meta(iec) if iec is not None else {}):
            ann = str((meta.get("annotations") or {}).get(contract.KV_DTYPE_ANNOTATION) or "").strip()
            if ann:
                if ann not in contract.LMCACHE_DTYPES:
                    raise PatchError(f"annotation {contract.KV_DTYPE_ANNOTATION}={ann!r}: want one of "
                                     f"{contract.LMCACHE_DTYPES}")
                dtype = ann
                break
    return dtype or cfg.kv_dtype, world


def endpoint_mount(dep: dict[str, Any], cfg: PatchConfig) -> tuple[str, str, str]:
    """(node directory, its path in the pod, the FUSE mount's path in the pod) of this endpoint's own l2fs mount
    (mount mode, hostPath). The mount DaemonSet serves each endpoint's prefix alone, with that endpoint's mount
    credential, at <host_path>/<endpoint>/<endpoint> (l2fs mount --endpoints), inside the plain directory
    <host_path>/<endpoint>. The pod's volume is that directory, mounted at <mount_path><prefix>, so the pod sees
    the FUSE mount where the whole tree would put that prefix (<mount_path><prefix>/<endpoint>): LMCache's fs://
    URL and the l2fs paths are those of before.

    Why the endpoint's own mount: with the node's one mount at <host_path> every vLLM pod on the node could write
    every endpoint's directory through it (a pod of A planted B's chunks, which B's engine then loaded). Why
    its parent directory, not the mount itself: a bind of the FUSE mount is a copy of it, dead with its daemon,
    and the restarted daemon's unmount and new mount propagate only to copies of the mount's PARENT
    (HostToContainer): the running pod kept ENOTCONN until it was restarted. With the parent bound, the remount
    reaches the running pod."""
    endpoint = contract.esc(owner_endpoint(dep) or _meta(dep).get("name") or "deployment")  # as endpoint_prefix
    at = f"{cfg.mount_path.rstrip('/')}{cfg.prefix.rstrip('/')}"
    return f"{cfg.host_path.rstrip('/')}/{endpoint}", at, f"{at}/{endpoint}"


def hostpath_mount(cfg: PatchConfig, at: str) -> dict[str, Any]:
    """The volumeMount of the endpoint's node directory (mount mode, hostPath) in the vLLM container and the
    init container: HostToContainer, so the mount DaemonSet's (re)mount inside it reaches the running pod;
    read-only, so nothing the pod does lands on the node's disk: the FUSE mount inside is a mount of its own
    (writable: a volume's readOnly does not reach the mounts below it; recursiveReadOnly, which would, is not
    allowed with propagation), and the directory around it and the bare mount point while nothing is mounted
    there refuse every write (EROFS), for a root container too."""
    return {"name": cfg.volume_name, "mountPath": at, "mountPropagation": "HostToContainer", "readOnly": True}


def _mounts_as(have: dict[str, Any], want: dict[str, Any]) -> bool:
    """Whether volumeMount `have` has every field of `want` (the API server may add others)."""
    return all(have.get(k) == v for k, v in want.items())


def wait_init(cfg: PatchConfig, image: str, at: str | None = None, wait_for: str | None = None) -> dict[str, Any]:
    """The init container that waits for the node's live l2fs mount (WAIT_INIT) at `wait_for` (default `at`),
    with the volume at `at` (default the config's mount path), in the vLLM image (python3)."""
    at = at or cfg.mount_path
    return {"name": WAIT_INIT, "image": image, "command": ["python3", "-c", WAIT_SCRIPT, wait_for or at],
            "volumeMounts": [hostpath_mount(cfg, at)],
            "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}


def _drop_wait_init(spec: dict[str, Any]) -> None:
    if spec.get("initContainers"):
        spec["initContainers"] = [x for x in spec["initContainers"] if x.get("name") != WAIT_INIT]
        if not spec["initContainers"]:
            del spec["initContainers"]


def _patch_worker(dep: dict[str, Any], cfg: PatchConfig, iec: dict[str, Any] | None = None,
                  old: dict[str, Any] | None = None) -> None:
    c = _containers(dep)[select_container(dep)]
    env: list[dict[str, Any]] = c.setdefault("env", [])
    revision, kv_prefix = endpoint_prefix(dep, cfg, iec)
    secret = salt_secret(dep, iec, old)
    _patch_salt(dep, c, secret)
    _patch_vllm_flags(c, cfg)
    if cfg.mode == "mp":
        _patch_mp(dep, c, cfg, chunk_dir(kv_prefix, secret), secret, token_secret(dep, cfg, iec, old))
    elif cfg.mode == "mount":
        _set_env(env, URL_VAR, cfg.url_for(chunk_dir(kv_prefix, secret)))
        # a token from a Secret is what an earlier plugin-mode patch added: mount-mode pods hold none
        env[:] = [e for e in env if e.get("name") != TOKEN_VAR or "secretKeyRef" not in (e.get("valueFrom") or {})]
    else:
        _drop_env(env, URL_VAR)
        _set_env(env, cfg.node_env, value_from={"fieldRef": {"fieldPath": "spec.nodeName"}})
        # LMCache's from_env() reads list settings as comma-separated names: the bare name, not JSON
        # ('["l2fs"]' is one plugin literally named so, found by no lookup: L1-only)
        _set_env(env, PLUGINS_VAR, cfg.plugin_name)
        _set_env(env, "LMCACHE_EXTRA_CONFIG", _extra_config(env, cfg, chunk_dir(kv_prefix, secret), revision))
        token = token_secret(dep, cfg, iec, old)
        if token:
            # not optional: a pod without the token would only ever miss; better it does not start
            _set_env(env, TOKEN_VAR, value_from={"secretKeyRef": {"name": token, "key": cfg.token_key}})
        else:
            _drop_env(env, TOKEN_VAR)
    _set_env(env, "LMCACHE_REMOTE_SERDE", cfg.serde)
    _set_env(env, "PYTHONHASHSEED", cfg.hash_seed)

    pod = dep["spec"]["template"]
    if cfg.mode == "mount":
        mount: dict[str, Any] = {"name": cfg.volume_name, "mountPath": cfg.mount_path}
        if cfg.pvc_name:
            volume: dict[str, Any] = {"name": cfg.volume_name,
                                      "persistentVolumeClaim": {"claimName": cfg.pvc_name}}
        else:
            # only this endpoint's mount, never the node's whole tree, and through its parent directory, so that a
            # FUSE remount by the l2fs-mount DaemonSet reaches the running pod (endpoint_mount, hostpath_mount)
            host, at, fuse = endpoint_mount(dep, cfg)
            mount = hostpath_mount(cfg, at)
            volume = {"name": cfg.volume_name, "hostPath": {"path": host, "type": "DirectoryOrCreate"}}
            _upsert(pod["spec"].setdefault("initContainers", []), wait_init(cfg, str(c.get("image") or ""), at, fuse),
                    lambda x: x.get("name") == WAIT_INIT)
    elif cfg.mode == "plugin" and cfg.data_path:
        # Same-node short-circuit: the co-located worker hands block fds over its Unix socket (l2fs/common/fdpass.py,
        # `--domain-socket /run/l2fs/worker.sock` in deploy/base/worker.yaml), at the path the worker reports, so
        # the pod sees that hostPath dir (only the socket in it) at the identical path. Read-only suffices to
        # connect; the pod never sees the data dir, so it cannot overwrite blocks or the manifest. (An older
        # --data-path pointing at the data dir still works: path-based reads, writes over the data plane.)
        mount = {"name": cfg.volume_name, "mountPath": cfg.data_path, "readOnly": True}
        volume = {"name": cfg.volume_name, "hostPath": {"path": cfg.data_path, "type": "DirectoryOrCreate"}}
    if not (cfg.mode == "mount" and not cfg.pvc_name):
        _drop_wait_init(pod["spec"])
    if cfg.mode == "mount" or (cfg.mode == "plugin" and cfg.data_path):
        _upsert(c.setdefault("volumeMounts", []), mount,
                lambda m: m.get("name") == cfg.volume_name or m.get("mountPath") == mount["mountPath"])
        _upsert(pod["spec"].setdefault("volumes", []), volume, lambda v: v.get("name") == cfg.volume_name)

    labels = pod.setdefault("metadata", {}).setdefault("labels", {})
    endpoint = owner_endpoint(dep) or _meta(dep).get("name")
    if endpoint:
        labels[ENDPOINT_LABEL] = endpoint
    pod_ann = pod["metadata"].setdefault("annotations", {})
    pod_ann[STRATEGY_KEY] = cfg.router_strategy
    pod_ann[REVISION_KEY] = revision
    pod_ann[KV_PREFIX_KEY] = kv_prefix  # where this endpoint revision's chunks are (for routers and humans)
    dtype, world = kv_layout(dep, c, cfg, iec)  # the other per-endpoint fields of its chunk keys (router)
    pod_ann[contract.KV_DTYPE_ANNOTATION] = dtype
    pod_ann[contract.KV_WORLD_SIZE_ANNOTATION] = str(world)
    if secret:
        pod_ann[KV_SALT_SECRET_KEY] = secret  # the router needs this endpoint's salt to find its chunks
    else:
        pod_ann.pop(KV_SALT_SECRET_KEY, None)
    token = token_secret(dep, cfg, iec, old) if cfg.mode in ("plugin", "mp") else ""
    if token:
        pod_ann[TOKEN_SECRET_KEY] = token  # kept across re-renders while the IEC cannot be read; verify reads it
    else:
        pod_ann.pop(TOKEN_SECRET_KEY, None)


MP_SIDECAR = "lmcache-server"
# mount mode: an init container that holds the vLLM container back until its endpoint's l2fs FUSE mount is live
# at <mount_path><prefix>/<endpoint> in the pod (a FUSE mount that answers, inside the read-only volume): without
# it a pod that starts before its node's mount (or while a killed one is stale) would start without its L2 (and
# before the volume was read-only it wrote its chunks onto the node's disk under the mount point)
WAIT_INIT = "kvtier-wait-l2fs"
WAIT_SCRIPT = """import os, sys, time
p, n = os.path.abspath(sys.argv[1]), 0
while True:
    kind = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split(" ")
            if fields[1] == p:
                kind = fields[2]
    if kind and kind.startswith("fuse"):
        try:
            os.listdir(p)
            sys.exit(0)
        except OSError:
            pass
    if n % 15 == 0:
        print(f"kvtier: waiting for the l2fs mount at {p} (now: {kind or 'not a mount'}); is this node's l2fs-mount pod running?", flush=True)
    n += 1
    time.sleep(2)
"""
MP_CONNECTOR = "LMCacheMPConnector"
MP_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"  # LMCache's own: vLLM's needs CUDA
MP_ADAPTER = {"type": "plugin", "module_path": "connector.mp_l2fs", "class_name": "L2fsL2Adapter"}
SHM_VOLUME = "kvtier-dshm"
# the sidecar's startup probe: its server accepts connections on loopback
MP_PROBE = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 3).close()"


def mp_transfer_config(cfg: PatchConfig, old: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM --kv-transfer-config for LMCache's MP connector talking to the pod's sidecar (over loopback)."""
    out = {k: v for k, v in (old or {}).items() if k in ("kv_load_failure_policy", "kv_buffer_device")}
    if cfg.kv_load_failure_policy:
        out["kv_load_failure_policy"] = cfg.kv_load_failure_policy
    out.update({"kv_connector": MP_CONNECTOR, "kv_connector_module_path": MP_CONNECTOR_MODULE,
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": cfg.mp_port,
                                              "lmcache.mp.mp_transfer_mode": "engine_driven"}})
    return out


def mp_sidecar(cfg: PatchConfig, image: str, kv_dir: str, salted: str, token: str) -> dict[str, Any]:
    """The `lmcache server` native sidecar: L1 in its own memory, kvtier's l2fs adapter as L2."""
    # the prefix is already the endpoint revision's directory (the adapter's model_revision would nest it again)
    params = {"master": cfg.master, "node_id": f"$({cfg.node_env})", "prefix": kv_dir}
    env: list[dict[str, Any]] = []
    if salted:  # the adapter's prefix names $(KVTIER_KV_SALT_DIR): the entry must come first
        env.append({"name": SALT_DIR_VAR,
                    "valueFrom": {"secretKeyRef": {"name": salted, "key": contract.SALT_DIR_SECRET_KEY}}})
    env.append({"name": cfg.node_env, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    if token:
        env.append({"name": TOKEN_VAR, "valueFrom": {"secretKeyRef": {"name": token, "key": cfg.token_key}}})
    env += [{"name": "PYTHONHASHSEED", "value": cfg.hash_seed}, {"name": "LMCACHE_TRACK_USAGE", "value": "false"}]
    return {"name": MP_SIDECAR, "image": cfg.mp_image or image, "restartPolicy": "Always",
            "command": ["lmcache", "server"],
            "args": ["--host", "127.0.0.1", "--port", str(cfg.mp_port), "--http-host", "127.0.0.1",
                     "--http-port", str(cfg.mp_http_port), "--chunk-size", str(contract.CHUNK_SIZE),
                     "--l1-size-gb", f"{cfg.mp_l1_gb:g}", "--eviction-policy", "LRU",
                     "--supported-transfer-mode", "engine_driven",
                     "--l2-adapter", json.dumps({**MP_ADAPTER, "adapter_params": params}, sort_keys=True)],
            "env": env,
            "resources": {"requests": {"memory": f"{int(cfg.mp_l1_gb + 1)}Gi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            # the server listens on loopback only, where a tcpSocket/httpGet probe (sent to the pod IP) never
            # reaches: the probe connects from inside the container. vLLM starts once it passes (native sidecar)
            "startupProbe": {"exec": {"command": ["python3", "-c", MP_PROBE, str(cfg.mp_port)]},
                             "periodSeconds": 2, "timeoutSeconds": 5, "failureThreshold": 150}}


def _patch_mp(dep: dict[str, Any], c: dict[str, Any], cfg: PatchConfig, kv_dir: str, salted: str,
              token: str) -> None:
    """MP mode: no in-process LMCache settings in the engine; the sidecar holds L1 and the l2fs credential."""
    env: list[dict[str, Any]] = c.setdefault("env", [])
    for name in (URL_VAR, PLUGINS_VAR, "LMCACHE_EXTRA_CONFIG"):
        _drop_env(env, name)
    env[:] = [e for e in env if e.get("name") != TOKEN_VAR or "secretKeyRef" not in (e.get("valueFrom") or {})]
    if _argv(c) is not None:
        _put_json_flag(c, KV_TRANSFER_FLAG, mp_transfer_config(cfg, _json_flag(c, KV_TRANSFER_FLAG)))
    spec = dep["spec"]["template"]["spec"]
    # one pod-level /dev/shm for both containers, a memory emptyDir: the operator's volume when it is one; a
    # hostPath /dev/shm (the HyperPod operator mounts the node's, for its managed tier's daemon, which mp mode
    # replaces) becomes one, so the pod keeps no hostPath (Pod Security baseline)
    shm = next((m.get("name") for m in c.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"), None)
    if shm is None:
        shm = SHM_VOLUME
        c.setdefault("volumeMounts", []).append({"name": shm, "mountPath": "/dev/shm"})
    vol = next((v for v in spec.get("volumes") or [] if v.get("name") == shm), None)
    if vol is None or "emptyDir" not in vol:
        _upsert(spec.setdefault("volumes", []), {"name": shm, "emptyDir": {"medium": "Memory"}},
                lambda v: v.get("name") == shm)
    side = mp_sidecar(cfg, str(c.get("image") or ""), kv_dir, salted, token)
    side["volumeMounts"] = [{"name": shm, "mountPath": "/dev/shm"}]
    _upsert(spec.setdefault("initContainers", []), side, lambda x: x.get("name") == MP_SIDECAR)


def _verify_mp(dep: dict[str, Any], c: dict[str, Any], cfg: PatchConfig, kv_dir: str) -> list[str]:
    problems = []
    transfer = _json_flag(c, KV_TRANSFER_FLAG) or {}
    if transfer.get("kv_connector") != MP_CONNECTOR or transfer.get("kv_connector_module_path") != MP_CONNECTOR_MODULE:
        problems.append(f"{KV_TRANSFER_FLAG}: mp mode wants {MP_CONNECTOR} from {MP_CONNECTOR_MODULE}, have {transfer}")
    sides = [x for x in dep["spec"]["template"]["spec"].get("initContainers") or [] if x.get("name") == MP_SIDECAR]
    if len(sides) != 1 or sides[0].get("restartPolicy") != "Always":
        problems.append(f"pod spec: mp mode wants one native sidecar {MP_SIDECAR} (restartPolicy Always)")
    else:
        args = [str(a) for a in sides[0].get("args") or []]
        raw = _flag_value(args, "--l2-adapter")
        try:
            have = (json.loads(raw) if raw else {}).get("adapter_params", {}).get("prefix")
        except (json.JSONDecodeError, AttributeError):
            have = None
        if have != kv_dir:
            problems.append(f"{MP_SIDECAR} --l2-adapter prefix: want {kv_dir!r}, have {have!r}")
    for e in c.get("env") or []:
        if e.get("name") in (URL_VAR, PLUGINS_VAR):
            problems.append(f"env {e.get('name')}: mp mode wants no in-process LMCache L2")
    return problems


def _patch_salt(dep: dict[str, Any], c: dict[str, Any], secret: str) -> None:
    """Tenant isolation: the salt Secret's "dir" as the FIRST env entry (kubelet expands $(VAR) only from
    entries above it) and the Secret mounted read-only (KVTIER_KV_SALT_FILE: kvtier code in the pod, e.g.
    `kvtier lmcache-config`). Without a Secret, everything of an earlier salted patch is removed."""
    env: list[dict[str, Any]] = c.setdefault("env", [])
    pod_spec = dep["spec"]["template"]["spec"]
    _drop_env(env, SALT_DIR_VAR)
    if not secret:
        _drop_env(env, contract.SALT_FILE_ENV)
        for holder, key in ((c, "volumeMounts"), (pod_spec, "volumes")):
            if holder.get(key):
                holder[key] = [x for x in holder[key] if x.get("name") != SALT_VOLUME]
        return
    env.insert(0, {"name": SALT_DIR_VAR,
                   "valueFrom": {"secretKeyRef": {"name": secret, "key": contract.SALT_DIR_SECRET_KEY}}})
    _set_env(env, contract.SALT_FILE_ENV, f"{SALT_MOUNT_PATH}/{contract.SALT_SECRET_KEY}")
    _upsert(c.setdefault("volumeMounts", []), {"name": SALT_VOLUME, "mountPath": SALT_MOUNT_PATH, "readOnly": True},
            lambda m: m.get("name") == SALT_VOLUME or m.get("mountPath") == SALT_MOUNT_PATH)
    _upsert(pod_spec.setdefault("volumes", []), {"name": SALT_VOLUME, "secret": {"secretName": secret,
                                                                                 "defaultMode": 0o440}},
            lambda v: v.get("name") == SALT_VOLUME)


def _patch_router(dep: dict[str, Any], cfg: PatchConfig) -> None:
    for c in _containers(dep):
        for key in ("args", "command"):
            words = c.get(key)
            if isinstance(words, list) and _set_flag(words, ROUTER_FLAG, cfg.router_strategy):
                break


def wants_patch(obj: dict[str, Any], all_owned: bool = False, iec: dict[str, Any] | None = None) -> bool:
    """Webhook gate: a router Deployment that opted in, or an IEC-owned Deployment whose endpoint lets
    kvtier provide its L2 (`l2_choice`) and that opted in on the Deployment or on the owning IEC.

    `iec` is the owning InferenceEndpointConfig when the caller could read it; without it only the
    Deployment is seen (a rendered redis:// URL still keeps it out). `all_owned` replaces the per-object
    opt-in (the webhook's namespaceSelector does the opting in; the operator's router is not IEC-owned,
    and a re-render would drop a hand-added marker), never the endpoint's own L2 choice."""
    if obj.get("kind") not in (None, "Deployment"):
        return False
    if is_router(obj):
        return opted_in(obj) or all_owned
    if owner_endpoint(obj) is None:
        return False
    if iec is not None:
        if not l2_choice(iec)[0]:
            return False
    elif _rendered_l2_is_redis(obj):
        return False
    return opted_in(obj) or all_owned or (iec is not None and opted_in(iec))


def mutate(dep: dict[str, Any], cfg: PatchConfig, iec: dict[str, Any] | None = None,
           old: dict[str, Any] | None = None) -> dict[str, Any]:
    """Patched deep copy of `dep`; raises PatchError (and changes nothing) when it cannot be patched.
    `iec` (the owning InferenceEndpointConfig, when read) decides the model revision; `old` (the object an
    UPDATE replaces) keeps a recorded KV salt when the IEC could not be read."""
    out = copy.deepcopy(dep)
    if is_router(out):
        _patch_router(out, cfg)
    else:
        _patch_worker(out, cfg, iec, old)
        refuse_privileged(out, cfg)
    out.setdefault("metadata", {}).setdefault("annotations", {})[PATCHED_KEY] = cfg.fingerprint()
    return out


# ---------------------------------------------------------------- JSON patch


def _ptr(parts: list[str]) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def diff(old: Any, new: Any, path: list[str] | None = None) -> list[dict[str, Any]]:
    """RFC 6902 ops turning `old` into `new`. Dicts are diffed key by key; a changed list is
    replaced whole, which stays correct whatever the list indices are. Equal inputs give []."""
    path = path or []
    if isinstance(old, dict) and isinstance(new, dict):
        ops: list[dict[str, Any]] = []
        for k in old:
            if k not in new:
                ops.append({"op": "remove", "path": _ptr(path + [k])})
        for k, v in new.items():
            if k not in old:
                ops.append({"op": "add", "path": _ptr(path + [k]), "value": v})
            else:
                ops += diff(old[k], v, path + [k])
        return ops
    if old == new and type(old) is type(new):
        return []
    return [{"op": "replace", "path": _ptr(path), "value": new}]


def plan(dep: dict[str, Any], cfg: PatchConfig, iec: dict[str, Any] | None = None,
         old: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """JSON patch that applies `cfg` to `dep` ([] when already applied)."""
    return diff(dep, mutate(dep, cfg, iec, old))


# ---------------------------------------------------------------- verify / revert


def check(dep: dict[str, Any], cfg: PatchConfig) -> list[str]:
    """Problems that keep `dep` from sharing KV through l2fs ([] when correctly patched)."""
    problems: list[str] = []
    if is_router(dep):
        for c in _containers(dep):
            words = (c.get("args") or []) + (c.get("command") or [])
            if _has_flag(c, ROUTER_FLAG) and cfg.router_strategy not in " ".join(map(str, words)):
                problems.append(f"router container {c.get('name')!r}: {ROUTER_FLAG} is not {cfg.router_strategy}")
        return problems
    try:
        c = _containers(dep)[select_container(dep)]
    except PatchError as e:
        return [str(e)]
    env = c.get("env") or []
    urls = [e for e in env if e.get("name") == URL_VAR]
    pod_ann = ((dep["spec"]["template"].get("metadata") or {}).get("annotations") or {})
    kv_prefix = str(pod_ann.get(KV_PREFIX_KEY) or "")
    if not kv_prefix.startswith(cfg.prefix.rstrip("/") + "/") or not pod_ann.get(REVISION_KEY):
        problems.append(f"pod annotations {KV_PREFIX_KEY}/{REVISION_KEY}: want a revision directory under "
                        f"{cfg.prefix}, have {kv_prefix or None}/{pod_ann.get(REVISION_KEY)}")

    def want(name: str, value: str) -> None:
        found = [e for e in env if e.get("name") == name]
        if len(found) != 1 or found[0].get("value") != value:
            problems.append(f"env {name}: want exactly one entry = {value!r}, have {found}")

    secret = str(pod_ann.get(KV_SALT_SECRET_KEY) or "")
    if secret:
        ref = {"name": secret, "key": contract.SALT_DIR_SECRET_KEY}
        if not env or env[0].get("name") != SALT_DIR_VAR or (env[0].get("valueFrom") or {}).get("secretKeyRef") != ref:
            problems.append(f"env {SALT_DIR_VAR}: want it first, from secret {ref}")
        vols = [v for v in dep["spec"]["template"]["spec"].get("volumes") or [] if v.get("name") == SALT_VOLUME]
        if len(vols) != 1 or (vols[0].get("secret") or {}).get("secretName") != secret:
            problems.append(f"pod spec: want one volume {SALT_VOLUME} of secret {secret!r}")
    try:
        layout = kv_layout(dep, c, cfg)
    except PatchError as e:
        problems.append(str(e))
    else:
        have = contract.pod_layout(pod_ann)
        # the flags fix the dtype when two different defaults give the same answer (else it came from the
        # annotation or cfg.kv_dtype, which verify cannot see: any valid recorded dtype is accepted)
        named = kv_layout({}, c, replace(cfg, kv_dtype="float"))[0] == kv_layout({}, c, replace(cfg, kv_dtype="half"))[0]
        if have is None or have[1] != layout[1] or (named and have[0] != layout[0]):
            problems.append(f"pod annotations {contract.KV_DTYPE_ANNOTATION}/{contract.KV_WORLD_SIZE_ANNOTATION}: "
                            f"want {layout[0]}/{layout[1]} (the router's L2 lookups need them), have "
                            f"{pod_ann.get(contract.KV_DTYPE_ANNOTATION)}/{pod_ann.get(contract.KV_WORLD_SIZE_ANNOTATION)}")
    kv_dir = chunk_dir(kv_prefix, secret)
    if cfg.mode == "mp":
        problems += _verify_mp(dep, c, cfg, kv_dir)
    elif cfg.mode == "mount":
        if len(urls) != 1 or urls[0].get("value") != cfg.url_for(kv_dir):
            problems.append(f"env {URL_VAR}: want exactly one entry = {cfg.url_for(kv_dir)!r}, have {urls}")
        host, at, fuse = endpoint_mount(dep, cfg) if not cfg.pvc_name else ("", cfg.mount_path, "")
        mounts = [m for m in c.get("volumeMounts") or [] if m.get("name") == cfg.volume_name]
        if len(mounts) != 1 or mounts[0].get("mountPath") != at:
            problems.append(f"container {c.get('name')!r}: want one volumeMount {cfg.volume_name} at {at}")
        elif host and not _mounts_as(mounts[0], hostpath_mount(cfg, at)):
            problems.append(f"container {c.get('name')!r}: want volumeMount {hostpath_mount(cfg, at)} (a remount of "
                            f"the node's FUSE mount reaches a running pod; nothing lands on the node's disk), "
                            f"have {mounts[0]}")
        vols = [v for v in dep["spec"]["template"]["spec"].get("volumes") or [] if v.get("name") == cfg.volume_name]
        if len(vols) != 1:
            problems.append(f"pod spec: want one volume named {cfg.volume_name}, have {len(vols)}")
        elif host and (vols[0].get("hostPath") or {}).get("path") != host:
            problems.append(f"pod spec: volume {cfg.volume_name} must be this endpoint's own mount {host} (the "
                            f"node's whole {cfg.host_path} lets its pods write every endpoint's KV), have "
                            f"{vols[0].get('hostPath')}")
        waits = [x for x in dep["spec"]["template"]["spec"].get("initContainers") or [] if x.get("name") == WAIT_INIT]
        wait_mounts = waits[0].get("volumeMounts") or [] if len(waits) == 1 else []
        if not cfg.pvc_name and (len(waits) != 1 or (waits[0].get("command") or [""])[-1] != fuse or len(wait_mounts) != 1
                                 or not _mounts_as(wait_mounts[0], hostpath_mount(cfg, at))):
            problems.append(f"pod spec: want init container {WAIT_INIT} waiting for the l2fs mount at {fuse} (no "
                            "L2 writes onto the node's disk before its l2fs mount is live)")
    else:
        if urls:
            problems.append(f"env {URL_VAR}: plugin mode wants none, have {urls}")
        want(PLUGINS_VAR, cfg.plugin_name)
        try:
            extra = json.loads(_env_value(env, "LMCACHE_EXTRA_CONFIG") or "{}")
        except json.JSONDecodeError:
            extra = {}
        have = extra.get(f"remote_storage_plugin.{cfg.plugin_name}.prefix") if isinstance(extra, dict) else None
        if have != kv_dir:
            problems.append(f"LMCACHE_EXTRA_CONFIG prefix: want {kv_dir!r}, have {have!r}")
        if cfg.token_secret:
            tokens = [e for e in env if e.get("name") == TOKEN_VAR]
            ref = {"name": token_secret(dep, cfg), "key": cfg.token_key}
            if len(tokens) != 1 or (tokens[0].get("valueFrom") or {}).get("secretKeyRef") != ref:
                problems.append(f"env {TOKEN_VAR}: want exactly one entry from secret {ref}, have {tokens}")
    want("LMCACHE_REMOTE_SERDE", cfg.serde)
    want("PYTHONHASHSEED", cfg.hash_seed)
    try:
        refuse_privileged(dep, cfg)
    except Refused as e:
        problems.append(str(e))
    transfer = _json_flag(c, KV_TRANSFER_FLAG)
    if cfg.kv_load_failure_policy and transfer is not None \
            and transfer.get("kv_load_failure_policy") != cfg.kv_load_failure_policy:
        problems.append(f"{KV_TRANSFER_FLAG}: want kv_load_failure_policy={cfg.kv_load_failure_policy!r}, "
                        f"have {transfer}")
    if cfg.kv_events_port and _argv(c) is not None:
        events = _json_flag(c, KV_EVENTS_FLAG) or {}
        if {k: events.get(k) for k in kv_events_config(cfg)} != kv_events_config(cfg):
            problems.append(f"{KV_EVENTS_FLAG}: want {kv_events_config(cfg)}, have {events or None}")
        have = {(p.get("name"), p.get("containerPort")) for p in c.get("ports") or []}
        for port in _named_ports(cfg):
            if (port["name"], port["containerPort"]) not in have:
                problems.append(f"container {c.get('name')!r}: want port {port['name']}={port['containerPort']}")
    return problems


def snapshot(dep: dict[str, Any]) -> str:
    """JSON of everything `mutate` may touch, taken before the first patch (for `revert`)."""
    c = {} if is_router(dep) else _containers(dep)[select_container(dep)]
    pod = dep["spec"]["template"]
    return json.dumps({
        "container": c.get("name"),
        "env": c.get("env"),
        "volumeMounts": c.get("volumeMounts"),
        "volumes": pod["spec"].get("volumes"),
        "podLabels": (pod.get("metadata") or {}).get("labels"),
        "podAnnotations": (pod.get("metadata") or {}).get("annotations"),
        "containers": [{"name": x.get("name"), "args": x.get("args"), "command": x.get("command"),
                        "ports": x.get("ports")} for x in _containers(dep)],
    }, sort_keys=True)


def restore(dep: dict[str, Any]) -> dict[str, Any]:
    """Deep copy of `dep` with the snapshot put back and our markers removed."""
    raw = (_meta(dep).get("annotations") or {}).get(SNAPSHOT_KEY)
    if not raw:
        raise PatchError(f"Deployment {_meta(dep).get('name')!r} has no {SNAPSHOT_KEY} annotation: "
                         "it was not patched by `kvtier operator-patch apply`, nothing to revert")
    try:
        snap = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PatchError(f"annotation {SNAPSHOT_KEY} is not valid JSON: {e}") from None
    out = copy.deepcopy(dep)
    containers = _containers(out)
    pod = out["spec"]["template"]

    def put(d: dict[str, Any], key: str, value: Any) -> None:
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value

    by_name = {c.get("name"): c for c in containers}
    if snap.get("container") is not None:
        if snap["container"] not in by_name:
            raise PatchError(f"container {snap['container']!r} from the snapshot is gone")
        c = by_name[snap["container"]]
        put(c, "env", snap.get("env"))
        put(c, "volumeMounts", snap.get("volumeMounts"))
    put(pod["spec"], "volumes", snap.get("volumes"))
    _drop_wait_init(pod["spec"])
    for item in snap.get("containers") or []:
        if item.get("name") in by_name:
            put(by_name[item["name"]], "args", item.get("args"))
            put(by_name[item["name"]], "command", item.get("command"))
            if "ports" in item:  # snapshots taken before ports were patched have no key: leave them
                put(by_name[item["name"]], "ports", item.get("ports"))
    pod.setdefault("metadata", {})
    put(pod["metadata"], "labels", snap.get("podLabels"))
    put(pod["metadata"], "annotations", snap.get("podAnnotations"))
    meta = out["metadata"]
    for field in ("annotations", "labels"):
        for key in (SNAPSHOT_KEY, PATCHED_KEY, OPT_IN_KEY):
            (meta.get(field) or {}).pop(key, None)
        if field in meta and not meta[field]:
            del meta[field]
    return out
