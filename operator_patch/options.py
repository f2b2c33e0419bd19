"""Command-line flags shared by `kvtier webhook` and `kvtier operator-patch`.

Both must agree on what "patched" means, so they build the same PatchConfig from the same flags.
Every flag also reads a KVTIER_* environment variable, which is how deploy/ feeds them from one
ConfigMap.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvtier import envs as kvtier_envs

from .patch import ROUTER_STRATEGIES, PatchConfig

_DEFAULTS = PatchConfig()
# flag -> (PatchConfig field, help)
_FLAGS: dict[str, tuple[str, str]] = {
    "--mode": ("mode", "mount: LMCache fs:// on the FUSE mount; plugin: LMCache remote-storage plugin; "
                       "mp: an `lmcache server` sidecar with kvtier's L2 adapter (LMCache multiprocess mode)"),
    "--mount-path": ("mount_path", "path of the l2fs mount inside vLLM pods"),
    "--prefix": ("prefix", "l2fs directory of the KV chunks (both modes; = the router's --l2fs-prefix)"),
    "--host-path": ("host_path", "node path under which the l2fs-mount DaemonSet mounts each endpoint (<path>/E/E)"),
    "--pvc": ("pvc_name", "mount this PVC instead of the hostPath"),
    "--volume-name": ("volume_name", "name of the injected volume"),
    "--serde": ("serde", "LMCACHE_REMOTE_SERDE value"),
    "--hash-seed": ("hash_seed", "PYTHONHASHSEED value (same in every pod)"),
    "--router-strategy": ("router_strategy", "routing strategy: " + "|".join(ROUTER_STRATEGIES)),
    "--plugin-name": ("plugin_name", "plugin mode: LMCache remote storage plugin name"),
    "--plugin-module": ("plugin_module", "plugin mode: module path of the plugin"),
    "--plugin-class": ("plugin_class", "plugin mode: class name of the plugin"),
    "--master": ("master", "plugin mode: l2fs master HOST:PORT"),
    "--data-path": ("data_path", "plugin mode: node dir mounted read-only for same-node short-circuit I/O: the workers' fd-passing socket dir (default /run/l2fs; a worker data dir also works, path-based reads only; '' = none)"),
    "--node-env": ("node_env", "plugin mode: env var carrying the node name"),
    "--kv-load-failure-policy": ("kv_load_failure_policy",
                                 "vLLM kv_load_failure_policy set in --kv-transfer-config (recompute|fail; "
                                 "'' = leave the operator's); needs vLLM >= 0.11.1"),
    "--token-secret": ("token_secret", "plugin mode: Secret in the workload namespace with the endpoint's "
                                       "engine-role l2fs token (env L2FS_TOKEN; {endpoint} = the endpoint name; "
                                       "annotation kvtier.io/l2fs-token-secret overrides); '' = no token, "
                                       "insecure dev clusters only"),
    "--token-key": ("token_key", "key of the token in --token-secret"),
    "--privileged-secrets": ("privileged_secrets", "comma-separated Secrets that hold l2fs worker/admin "
                                                   "credentials: an endpoint pod that would get one is refused"),
    "--kv-events-port": ("kv_events_port", "vLLM KV-events ZMQ PUB port, named container port 'kv-events' "
                                           "(0 = no --kv-events-config)"),
    "--kv-replay-port": ("kv_replay_port", "vLLM KV-events replay port, named 'kv-replay' (0 = none)"),
    "--mp-port": ("mp_port", "mp mode: the lmcache server sidecar's loopback port"),
    "--mp-http-port": ("mp_http_port", "mp mode: the sidecar's HTTP admin port, loopback (LMCache's default 8080 "
                                       "is vLLM's port on HyperPod)"),
    "--mp-l1-gb": ("mp_l1_gb", "mp mode: host memory (GB) of the sidecar's L1"),
    "--mp-image": ("mp_image", "mp mode: the sidecar's image ('' = the vLLM container's, which must hold "
                               "LMCache and kvtier)"),
    "--kv-dtype": ("kv_dtype", "LMCache dtype of the KV when the vLLM args name none (--dtype auto): "
                               "bfloat16|half|float; annotation kvtier.io/kv-dtype overrides; recorded on the "
                               "pod for the router's L2 lookups"),
}


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Add the PatchConfig flags (defaults: $KVTIER_<FLAG>, else PatchConfig's)."""
    known = {f.name for f in fields(PatchConfig)}
    group = parser.add_argument_group("patch settings (env KVTIER_<FLAG> sets the default)")
    for flag, (field, help_) in _FLAGS.items():
        assert field in known, field
        env = kvtier_envs.patch_flag(flag)
        default = env if env is not None else getattr(_DEFAULTS, field)
        group.add_argument(flag, dest=field, default=default, help=f"{help_} (default {default!r})")


def config_from_args(ns: argparse.Namespace) -> PatchConfig:
    """PatchConfig from parsed flags; raises ValueError with a readable message on bad values."""
    return PatchConfig(**{field: getattr(ns, field) for field, _ in _FLAGS.values()})


def flag_env(flag: str) -> str:
    """The KVTIER_<FLAG> name of a flag (what deploy/'s kvtier-config ConfigMap sets for the webhook)."""
    return "KVTIER_" + flag.lstrip("-").replace("-", "_").upper()


def fill_unset(ns: argparse.Namespace, settings: dict[str, str], given: set[str]) -> list[str]:
    """Flags neither on the command line (`given`) nor in this environment take `settings`' KVTIER_* values
    (the running webhook's): so `verify` checks what the webhook patched with, not the defaults (mount mode,
    the default master), which a plugin-mode endpoint fails. Returns the flags filled in."""
    filled = []
    for flag, (field, _) in _FLAGS.items():
        if flag in given or kvtier_envs.patch_flag(flag) is not None or flag_env(flag) not in settings:
            continue
        setattr(ns, field, settings[flag_env(flag)])
        filled.append(flag)
    return filled

