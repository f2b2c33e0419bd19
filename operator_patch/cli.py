"""`kvtier operator-patch apply|verify|revert --namespace NS --endpoint NAME`.

The one-time procedure from the Curvine/HyperPod write-up, made safe to re-run:
pause the (closed-source) inference operator so its reconcile cannot undo the patch, drain the model
Deployment (avoids a maxSurge deadlock when replicas == GPUs), JSON-patch it, wait for the rollout,
then restore the operator. Progress is recorded in annotations (paused replicas on the controller,
original replicas and a pre-patch snapshot on the model Deployment), so an interrupted run is
finished by running it again. Every check that can fail (CRD, endpoint, Deployment, container,
controller) runs before the first write.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from .options import add_config_args, config_from_args, fill_unset
from .patch import (
    IEC_GROUP,
    IEC_KIND,
    IEC_PLURAL,
    OPT_IN_KEY,
    PATCHED_KEY,
    SNAPSHOT_KEY,
    PatchConfig,
    PatchError,
    check,
    diff,
    l2_choice,
    mutate,
    restore,
    snapshot,
    token_secret,
)

PAUSED_KEY = "kvtier.io/paused-replicas"  # on the operator controller: replicas before we paused it
REPLICAS_KEY = "kvtier.io/original-replicas"  # on the model Deployment: replicas before the drain
CONTROLLER_NAMES = ("hyperpod-inference-operator-controller-manager", "hyperpod-inference-controller-manager")
WEBHOOK_CONFIG = "kvtier-operator-patch"
WEBHOOK_DEPLOYMENT = "kvtier-webhook"  # deploy/base/webhook.yaml: its env is the patch settings
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"


class CliError(Exception):
    """A clear, user-facing failure; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 2) -> None:
        super().__init__(msg)
        self.code = code


@dataclass
class Kube:
    """The few API groups we use, built from one ApiClient."""

    apps: Any
    custom: Any
    ext: Any
    admission: Any
    core: Any

    @classmethod
    def connect(cls, kubeconfig: str | None, context: str | None) -> Kube:
        from kubernetes import client, config

        try:
            if kubeconfig or context:
                config.load_kube_config(config_file=kubeconfig, context=context)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
        except Exception as e:  # noqa: BLE001 - the loaders raise several unrelated types
            raise CliError(f"cannot load Kubernetes credentials: {e}") from None
        api = client.ApiClient()
        return cls(client.AppsV1Api(api), client.CustomObjectsApi(api), client.ApiextensionsV1Api(api),
                   client.AdmissionregistrationV1Api(api), client.CoreV1Api(api))


def _status(e: Exception) -> int | None:
    return getattr(e, "status", None)


def _plain(obj: Any) -> dict[str, Any]:
    """API model or dict -> the JSON dict the API server sent (camelCase keys)."""
    if isinstance(obj, dict):
        return obj
    from kubernetes import client

    return client.ApiClient().sanitize_for_serialization(obj)


class Procedure:
    """apply / verify / revert for one endpoint."""

    def __init__(self, kube: Kube, ns: argparse.Namespace, cfg: PatchConfig) -> None:
        self.k, self.ns, self.cfg = kube, ns, cfg
        self.namespace: str = ns.namespace
        self.endpoint: str = ns.endpoint
        self.iec: dict[str, Any] | None = None  # read by preflight

    def say(self, msg: str) -> None:
        print(f"operator-patch: {msg}", flush=True)

    # ------------------------------------------------------------ reads

    def preflight(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(model Deployment, operator controller Deployment or None); raises CliError, writes nothing."""
        from kubernetes.client.exceptions import ApiException

        crd = f"{IEC_PLURAL}.{IEC_GROUP}"
        try:
            self.k.ext.read_custom_resource_definition(crd)
        except ApiException as e:
            if _status(e) == 404:
                raise CliError(f"CRD {crd} is not installed: is the HyperPod inference operator installed "
                               "in this cluster?") from None
            raise CliError(f"reading CRD {crd}: HTTP {e.status} {e.reason}") from None
        iec = None
        for version in ("v1", "v1alpha1"):  # older operator builds serve only v1alpha1
            try:
                iec = self.k.custom.get_namespaced_custom_object(IEC_GROUP, version, self.namespace, IEC_PLURAL,
                                                                 self.endpoint)
                break
            except ApiException as e:
                if _status(e) != 404:
                    raise CliError(f"reading {IEC_KIND} {self.namespace}/{self.endpoint}: HTTP {e.status} "
                                   f"{e.reason}") from None
        if iec is None:
            raise CliError(f"{IEC_KIND} {self.namespace}/{self.endpoint} not found")
        allowed, why = l2_choice(iec)
        if not allowed and self.ns.action == "apply":
            raise CliError(f"{IEC_KIND} {self.namespace}/{self.endpoint}: not taking over its L2: {why}. kvtier "
                           "provides L2 only for kvCacheSpec {enableL2Cache: true, l2CacheSpec: {l2CacheBackend: "
                           "tieredstorage}}; edit the endpoint first if that is what you want")
        self.iec = iec  # decides the model revision (the KV prefix) in mutate
        dep = self.find_deployment(iec)
        ctrl = None if self.ns.no_pause else self.find_controller()
        return dep, ctrl

    def find_deployment(self, iec: dict[str, Any]) -> dict[str, Any]:
        uid = (iec.get("metadata") or {}).get("uid")
        items = [_plain(d) for d in self.k.apps.list_namespaced_deployment(self.namespace).items]
        owned = [d for d in items if any(
            r.get("kind") == IEC_KIND and r.get("name") == self.endpoint and (not uid or r.get("uid") in (None, uid))
            for r in (d["metadata"].get("ownerReferences") or []))]
        if len(owned) > 1:
            names = [d["metadata"]["name"] for d in owned]
            raise CliError(f"{IEC_KIND} {self.endpoint} owns several Deployments {names}; patch is ambiguous")
        if owned:
            return owned[0]
        named = [d for d in items if d["metadata"]["name"] == self.endpoint]
        if named:
            return named[0]
        raise CliError(f"{IEC_KIND} {self.namespace}/{self.endpoint} has no rendered Deployment yet "
                       "(is the operator still deploying it?)")

    def find_controller(self) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        cns = self.ns.controller_namespace
        names = [self.ns.controller] if self.ns.controller else list(CONTROLLER_NAMES)
        for name in names:
            try:
                return _plain(self.k.apps.read_namespaced_deployment(name, cns))
            except ApiException as e:
                if _status(e) != 404:
                    raise CliError(f"reading {cns}/{name}: HTTP {e.status} {e.reason}") from None
        if not self.ns.controller:
            for d in self.k.apps.list_namespaced_deployment(cns).items:
                d = _plain(d)
                if "inference" in d["metadata"]["name"] and d["metadata"]["name"].endswith("controller-manager"):
                    return d
        raise CliError(f"operator controller not found in namespace {cns} (tried {names}); pass --controller NAME, "
                       "or --no-pause if the operator is not running")

    def reflect_token(self, dep: dict[str, Any]) -> None:
        """Plugin mode: a per-endpoint engine token Secret (the default, `{endpoint}` in --token-secret, or the
        annotation) must already exist in the workload namespace (`kvtier tokens generate --secret-yaml` puts it
        there); a fixed name (the old shared token) is copied from the l2fs namespace (a pod can only reference
        Secrets of its own namespace). Only the token key is copied."""
        from kubernetes.client.exceptions import ApiException

        name, key, src_ns = token_secret(dep, self.cfg, self.iec), self.cfg.token_key, self.ns.token_namespace
        if self.cfg.mode != "plugin" or not name:
            return
        if "{endpoint}" in self.cfg.token_secret or name != self.cfg.token_secret:
            problems = self.token_problems(dep)
            if problems:
                raise CliError("; ".join(problems) + f"; create it: kvtier tokens generate --engine "
                               f"{self.endpoint}@{self.namespace} ... --secret-yaml - (docs/deploy.md, Tokens)")
            return
        if src_ns == self.namespace:
            return
        try:
            src = _plain(self.k.core.read_namespaced_secret(name, src_ns))
        except ApiException as e:
            raise CliError(f"Secret {src_ns}/{name} (the l2fs token) not readable: HTTP {e.status} {e.reason}; "
                           f"create it (docs/deploy.md) or pass --token-secret '' on an insecure dev cluster") from None
        value = (src.get("data") or {}).get(key)
        if not value:
            raise CliError(f"Secret {src_ns}/{name} has no key {key!r}")
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/managed-by": "kvtier-operator-patch"},
                             "annotations": {"kvtier.io/reflected-from": f"{src_ns}/{name}"}},
                "data": {key: value}}
        try:
            cur = _plain(self.k.core.read_namespaced_secret(name, self.namespace))
        except ApiException as e:
            if e.status != 404:
                raise CliError(f"reading Secret {self.namespace}/{name}: HTTP {e.status} {e.reason}") from None
            self.say(f"copying the l2fs token Secret {src_ns}/{name} to {self.namespace}/{name}")
            self.k.core.create_namespaced_secret(self.namespace, body)
            return
        if (cur.get("data") or {}).get(key) != value:
            self.say(f"updating the l2fs token in Secret {self.namespace}/{name} from {src_ns}/{name}")
            self.k.core.patch_namespaced_secret(name, self.namespace, {"data": {key: value}})

    def token_problems(self, dep: dict[str, Any]) -> list[str]:
        """Plugin mode: the token Secret the pods reference must exist in their namespace (or they never start)."""
        from kubernetes.client.exceptions import ApiException

        name = token_secret(dep, self.cfg, self.iec)
        if self.cfg.mode != "plugin" or not name:
            return []
        try:
            data = _plain(self.k.core.read_namespaced_secret(name, self.namespace)).get("data") or {}
        except ApiException as e:
            return [f"Secret {self.namespace}/{name} (l2fs token): HTTP {e.status} {e.reason}"]
        return [] if data.get(self.cfg.token_key) else [f"Secret {self.namespace}/{name} has no key {self.cfg.token_key!r}"]

    def read(self, name: str, namespace: str) -> dict[str, Any]:
        return _plain(self.k.apps.read_namespaced_deployment(name, namespace))

    # ------------------------------------------------------------ writes

    def merge(self, name: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return _plain(self.k.apps.patch_namespaced_deployment(name, namespace, body, _content_type=MERGE_PATCH))

    def json_patch(self, dep: dict[str, Any], new: dict[str, Any]) -> None:
        """Apply old->new as a JSON patch guarded by a resourceVersion test (no lost updates)."""
        ops = diff(dep, new)
        if not ops:
            return
        rv = dep["metadata"].get("resourceVersion")
        if rv is not None:
            ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}] + ops
        self.k.apps.patch_namespaced_deployment(dep["metadata"]["name"], dep["metadata"]["namespace"], ops,
                                                _content_type=JSON_PATCH)

    def write(self, name: str, change: Any, what: str, attempts: int = 5) -> None:
        """Read, compute `change(dep)`, JSON-patch; on a 409 (someone wrote in between) start over."""
        from kubernetes.client.exceptions import ApiException

        for attempt in range(attempts):
            dep = self.read(name, self.namespace)
            new = change(dep)
            self.say(f"{what} {self.namespace}/{name}: {len(diff(dep, new))} JSON-patch ops")
            try:
                self.json_patch(dep, new)
                return
            except ApiException as e:
                if _status(e) != 409 or attempt == attempts - 1:
                    raise
                self.say(f"{self.namespace}/{name} changed while patching; retrying")

    def wait(self, name: str, namespace: str, what: str, done: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.ns.timeout
        while True:
            dep = self.read(name, namespace)
            if done(dep):
                return dep
            if time.monotonic() > deadline:
                raise CliError(f"timed out after {self.ns.timeout:.0f}s waiting for {namespace}/{name} to {what}; "
                               f"status={json.dumps(dep.get('status') or {})}", code=3)
            time.sleep(self.ns.poll)

    @staticmethod
    def rolled_out(dep: dict[str, Any]) -> bool:
        spec, st = dep.get("spec") or {}, dep.get("status") or {}
        want = spec.get("replicas", 1)
        gen = (dep.get("metadata") or {}).get("generation")
        if gen is not None and (st.get("observedGeneration") or 0) < gen:
            return False
        return (st.get("updatedReplicas") or 0) == want and (st.get("readyReplicas") or 0) == want \
            and (st.get("availableReplicas") or 0) == want and (st.get("replicas") or 0) == want

    @staticmethod
    def scaled_to_zero(dep: dict[str, Any]) -> bool:
        st = dep.get("status") or {}
        gen = (dep.get("metadata") or {}).get("generation")
        if gen is not None and (st.get("observedGeneration") or 0) < gen:
            return False
        return not st.get("replicas")

    def pause(self, ctrl: dict[str, Any] | None) -> None:
        if ctrl is None:
            return
        m = ctrl["metadata"]
        annotations = m.get("annotations") or {}
        if PAUSED_KEY not in annotations:
            replicas = (ctrl.get("spec") or {}).get("replicas", 1)
            self.say(f"pausing operator {m['namespace']}/{m['name']} (replicas {replicas} -> 0)")
            self.merge(m["name"], m["namespace"], {"metadata": {"annotations": {PAUSED_KEY: str(replicas)}},
                                                   "spec": {"replicas": 0}})
        else:
            self.say(f"operator {m['namespace']}/{m['name']} already paused by an earlier run")
            if (ctrl.get("spec") or {}).get("replicas"):
                self.merge(m["name"], m["namespace"], {"spec": {"replicas": 0}})
        self.wait(m["name"], m["namespace"], "scale to 0", self.scaled_to_zero)

    def resume(self, ctrl: dict[str, Any] | None) -> None:
        if ctrl is None:
            return
        m = ctrl["metadata"]
        cur = self.read(m["name"], m["namespace"])
        saved = (cur["metadata"].get("annotations") or {}).get(PAUSED_KEY)
        if saved is None:
            return
        self.say(f"restoring operator {m['namespace']}/{m['name']} to {saved} replicas")
        self.merge(m["name"], m["namespace"], {"metadata": {"annotations": {PAUSED_KEY: None}},
                                               "spec": {"replicas": int(saved)}})

    def drain(self, dep: dict[str, Any]) -> dict[str, Any]:
        """Scale the model Deployment to 0, remembering its replicas; returns the fresh object."""
        m = dep["metadata"]
        if self.ns.no_drain:
            return dep
        annotations = m.get("annotations") or {}
        body: dict[str, Any] = {"spec": {"replicas": 0}}
        if REPLICAS_KEY not in annotations:
            body["metadata"] = {"annotations": {REPLICAS_KEY: str((dep.get("spec") or {}).get("replicas", 1))}}
        if (dep.get("spec") or {}).get("replicas") or "metadata" in body:
            self.say(f"draining {m['namespace']}/{m['name']} to 0 replicas")
            self.merge(m["name"], m["namespace"], body)
        return self.wait(m["name"], m["namespace"], "scale to 0", self.scaled_to_zero)

    def undrained(self, new: dict[str, Any]) -> dict[str, Any]:
        """`new` with the replicas saved by drain() put back and the marker removed."""
        saved = (new["metadata"].get("annotations") or {}).pop(REPLICAS_KEY, None)
        if saved is not None:
            new["spec"]["replicas"] = int(saved)
        return new

    # ------------------------------------------------------------ commands

    def apply(self) -> int:
        dep, ctrl = self.preflight()
        name = dep["metadata"]["name"]
        mutate(dep, self.cfg, self.iec)  # PatchError (e.g. no vLLM container) before any write
        self.reflect_token(dep)  # before the pods that reference it start
        ctrl_paused = ctrl is not None and PAUSED_KEY in (ctrl["metadata"].get("annotations") or {})
        if not self.todo(dep) and not ctrl_paused and self.rolled_out(dep):
            self.say(f"{self.namespace}/{name} is already patched and rolled out; nothing to do")
            return 0
        self.pause(ctrl)
        try:
            dep = self.read(name, self.namespace)  # the operator may have re-rendered before it stopped
            mutate(dep, self.cfg, self.iec)
            if self.todo(dep):
                self.drain(dep)
                self.write(name, self.target, "patching")
            elif REPLICAS_KEY in (dep["metadata"].get("annotations") or {}):
                self.write(name, lambda d: self.undrained(json.loads(json.dumps(d))), "scaling back")
        except Exception:
            self.rollback(name, ctrl)
            raise
        self.say(f"waiting for {self.namespace}/{name} to roll out")
        self.wait(name, self.namespace, "roll out", self.rolled_out)
        self.resume(ctrl)
        problems = check(self.read(name, self.namespace), self.cfg)
        if problems:
            raise CliError("patched, but verification failed: " + "; ".join(problems), code=1)
        self.say(f"applied: {self.namespace}/{name} uses l2fs ({self.cfg.mode} mode)")
        self.warn_webhook()
        return 0

    def todo(self, dep: dict[str, Any]) -> bool:
        """True when the patch (or our bookkeeping) still has to be written."""
        new = mutate(dep, self.cfg, self.iec)
        new["metadata"]["annotations"].pop(SNAPSHOT_KEY, None)
        old = json.loads(json.dumps(dep))
        (old["metadata"].get("annotations") or {}).pop(SNAPSHOT_KEY, None)
        return bool(diff(old, new))

    def target(self, dep: dict[str, Any]) -> dict[str, Any]:
        new = mutate(dep, self.cfg, self.iec)
        ann = new["metadata"].setdefault("annotations", {})
        ann.setdefault(SNAPSHOT_KEY, snapshot(dep))  # first patch only: the operator's rendering
        ann[OPT_IN_KEY] = "enabled"  # so the webhook (if installed) keeps re-applying it
        return self.undrained(new)

    def rollback(self, name: str, ctrl: dict[str, Any] | None) -> None:
        """Best effort after a failed write: undo the drain and the pause, leave the template alone."""
        try:
            cur = self.read(name, self.namespace)
            saved = (cur["metadata"].get("annotations") or {}).get(REPLICAS_KEY)
            if saved is not None:
                self.merge(name, self.namespace, {"metadata": {"annotations": {REPLICAS_KEY: None}},
                                                  "spec": {"replicas": int(saved)}})
            self.resume(ctrl)
        except Exception as e:  # noqa: BLE001 - report the original error, not this one
            self.say(f"rollback incomplete ({e}); re-run the command")

    def verify(self) -> int:
        dep, ctrl = self.preflight()
        name = dep["metadata"]["name"]
        problems = check(dep, self.cfg)
        problems += self.token_problems(dep)
        if not self.rolled_out(dep):
            problems.append(f"rollout not complete: status={json.dumps(dep.get('status') or {})}")
        if ctrl is not None and PAUSED_KEY in (ctrl["metadata"].get("annotations") or {}):
            problems.append(f"operator {ctrl['metadata']['name']} is still paused by an unfinished run")
        if problems:
            for p in problems:
                self.say(f"FAIL {p}")
            if PATCHED_KEY not in (dep["metadata"].get("annotations") or {}):
                # never patched: typically created before the webhook answered (failurePolicy Ignore admits it
                # as rendered) or in a namespace it does not watch; its next UPDATE goes through the webhook
                self.say(f"FIX {self.namespace}/{name} was admitted unpatched (created before the webhook "
                         f"answered, or its namespace lacks the label kvtier.io/l2fs-webhook=enabled): "
                         f"`kubectl -n {self.namespace} rollout restart deployment/{name}` has the webhook patch "
                         f"it and rolls its pods, or `kvtier operator-patch apply` patches it without the webhook")
            return 1
        self.say(f"OK {self.namespace}/{name}: {self.cfg.mode} mode, exactly one L2 setting, rollout complete")
        self.warn_webhook()
        return 0

    def revert(self) -> int:
        dep, ctrl = self.preflight()
        name = dep["metadata"]["name"]
        restore(dep)  # PatchError if there is no snapshot: before any write
        self.pause(ctrl)
        try:
            self.drain(self.read(name, self.namespace))
            self.write(name, lambda d: self.undrained(restore(d)), "reverting")
        except Exception:
            self.rollback(name, ctrl)
            raise
        self.wait(name, self.namespace, "roll out", self.rolled_out)
        self.resume(ctrl)
        self.say(f"reverted {self.namespace}/{name} to the operator's rendering")
        return 0

    def warn_webhook(self) -> None:
        try:
            self.k.admission.read_mutating_webhook_configuration(WEBHOOK_CONFIG)
        except Exception:  # noqa: BLE001 - any failure here is reported, never fatal
            self.say(f"warning: MutatingWebhookConfiguration {WEBHOOK_CONFIG} not found; the next operator "
                     "re-render (CRD edit, upgrade) will drop this patch. Deploy deploy/base/webhook.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier operator-patch",
        description="Point an InferenceEndpointConfig's rendered Deployment at l2fs: pause the HyperPod "
                    "inference operator, drain, JSON-patch, wait for the rollout, restore the operator. "
                    "Safe to re-run; `verify` checks, `revert` restores the operator's rendering.")
    p.add_argument("action", choices=("apply", "verify", "revert"))
    p.add_argument("--namespace", "-n", required=True, help="namespace of the InferenceEndpointConfig")
    p.add_argument("--endpoint", required=True, help="InferenceEndpointConfig name")
    p.add_argument("--controller-namespace", default="hyperpod-inference-system")
    p.add_argument("--controller", default="", help="operator controller Deployment (default: discover)")
    p.add_argument("--no-pause", action="store_true", help="do not scale the operator controller down")
    p.add_argument("--no-drain", action="store_true",
                   help="patch in place (rolling update) instead of scaling the model to 0 first")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for each scale/rollout")
    p.add_argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    p.add_argument("--token-namespace", default="kvtier",
                   help="plugin mode: namespace of the l2fs token Secret that `apply` copies into --namespace")
    p.add_argument("--webhook-namespace", default="kvtier",
                   help="where the kvtier webhook runs: patch settings not given here (flag or KVTIER_* env) "
                        "are the ones it patches with")
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--context", default=None)
    add_config_args(p)
    return p


def webhook_settings(k: Kube, namespace: str) -> dict[str, str]:
    """The KVTIER_* settings the installed webhook (Deployment kvtier-webhook) patches with: its containers'
    envFrom ConfigMaps and plain env values; {} when it is not installed or cannot be read."""
    try:
        dep = k.apps.read_namespaced_deployment(WEBHOOK_DEPLOYMENT, namespace)
    except Exception:  # noqa: BLE001 - no webhook (or no right to read it): the flags alone decide
        return {}
    out: dict[str, str] = {}
    for c in dep.spec.template.spec.containers or []:
        for src in c.env_from or []:
            if src.config_map_ref is not None:
                try:
                    out.update(k.core.read_namespaced_config_map(src.config_map_ref.name, namespace).data or {})
                except Exception:  # noqa: BLE001
                    continue
        out.update({e.name: e.value for e in c.env or [] if e.value is not None})
    return {name: str(v) for name, v in out.items() if name.startswith("KVTIER_")}


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = sys.argv[1:] if argv is None else argv
    ns = p.parse_args(args)
    try:
        cfg = config_from_args(ns)
        kube = Kube.connect(ns.kubeconfig, ns.context)
        filled = fill_unset(ns, webhook_settings(kube, ns.webhook_namespace), {a.split("=", 1)[0] for a in args})
        if filled:
            print(f"operator-patch: {', '.join(filled)} as the webhook in {ns.webhook_namespace} has them",
                  flush=True)
            cfg = config_from_args(ns)
    except ValueError as e:
        p.error(str(e))
    except CliError as e:
        print(f"operator-patch: error: {e}", file=sys.stderr)
        return e.code
    try:
        proc = Procedure(kube, ns, cfg)
        return int(getattr(proc, ns.action)())
    except CliError as e:
        print(f"operator-patch: error: {e}", file=sys.stderr)
        return e.code
    except PatchError as e:
        print(f"operator-patch: error: {e} (nothing was changed)", file=sys.stderr)
        return 2
    except Exception as e:
        from kubernetes.client.exceptions import ApiException

        if isinstance(e, ApiException):
            body = (e.body or "")[:500] if isinstance(e.body, str) else e.body
            print(f"operator-patch: error: API server said HTTP {e.status} {e.reason}: {body}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
