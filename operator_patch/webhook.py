"""`kvtier webhook`: mutating admission webhook that re-applies the l2fs patch on every render.

The HyperPod inference operator re-renders its worker Deployment on any CRD edit or upgrade, which
drops a one-time `kubectl patch`. Kubernetes calls this webhook on each CREATE/UPDATE of a
Deployment; for opted-in, InferenceEndpointConfig-owned ones it answers with a JSON patch
(operator_patch.patch), for everything else with an empty "allowed". A Deployment it cannot patch is
admitted unchanged with a warning, so a webhook problem costs cache hits, not deployments. The one denial:
an endpoint pod that would hold an l2fs worker/admin credential (a Secret in --privileged-secrets), since
such a pod could poison or delete every endpoint's KV (patch.Refused). Served over TLS only.

The owning InferenceEndpointConfig is read (get only) for two decisions the Deployment cannot tell:
the endpoint's own L2 choice (redis / L2 disabled are left alone) and an opt-in written on the IEC.
When it cannot be read the Deployment alone decides, as before.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from .options import add_config_args, config_from_args
from .patch import (
    IEC_GROUP,
    IEC_KIND,
    IEC_PLURAL,
    PatchConfig,
    PatchError,
    Refused,
    l2_choice,
    plan,
    wants_patch,
)

log = logging.getLogger("kvtier.webhook")
REVIEW_API = "admission.k8s.io/v1"


class BadReview(ValueError):
    """The request body is not an AdmissionReview v1 request."""


def parse_review(body: bytes) -> dict[str, Any]:
    """The `request` part of an AdmissionReview v1, or BadReview with a message saying what is wrong."""
    try:
        review = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadReview(f"body is not JSON: {e}") from None
    if not isinstance(review, dict):
        raise BadReview("body must be a JSON object (an AdmissionReview)")
    if review.get("kind") != "AdmissionReview" or review.get("apiVersion") != REVIEW_API:
        raise BadReview(f"want kind AdmissionReview, apiVersion {REVIEW_API}; got kind={review.get('kind')!r} "
                        f"apiVersion={review.get('apiVersion')!r}")
    req = review.get("request")
    if not isinstance(req, dict):
        raise BadReview("AdmissionReview has no 'request' object")
    if not isinstance(req.get("uid"), str) or not req["uid"]:
        raise BadReview("request.uid must be a non-empty string")
    obj = req.get("object")
    if obj is not None and not isinstance(obj, dict):
        raise BadReview("request.object must be an object or null")
    return req


class IecReader:
    """Reads the InferenceEndpointConfig that owns a Deployment (RBAC: get on inferenceendpointconfigs)."""

    def __init__(self, api: Any, timeout: float = 2.0) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api)
        self.timeout = timeout  # the API server gives the whole webhook call 5 s (timeoutSeconds)

    @classmethod
    def connect(cls, api_url: str | None) -> IecReader | None:
        """In-cluster credentials (or `api_url`, tests), else kubeconfig; None when there are none."""
        from kubernetes import client, config

        if api_url:
            conf = client.Configuration()
            conf.host = api_url
            return cls(client.ApiClient(conf))
        try:
            config.load_incluster_config()
        except config.ConfigException:
            try:
                config.load_kube_config()
            except Exception as e:  # noqa: BLE001 - no usable kubeconfig in any of its several ways
                log.warning("no Kubernetes credentials (%s): InferenceEndpointConfigs are not read; "
                            "the Deployment alone decides", e)
                return None
        return cls(client.ApiClient())

    def get(self, obj: dict[str, Any], namespace: str) -> tuple[dict[str, Any] | None, str]:
        """(owning IEC or None, result label: ok | not_found | error | not_owned)."""
        from kubernetes.client.exceptions import ApiException

        ref = next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or []
                    if r.get("kind") == IEC_KIND and str(r.get("apiVersion", "")).startswith(IEC_GROUP + "/")), None)
        if ref is None or not namespace:
            return None, "not_owned"
        version = str(ref["apiVersion"]).split("/", 1)[1]
        try:
            iec = self.custom.get_namespaced_custom_object(IEC_GROUP, version, namespace, IEC_PLURAL, ref.get("name"),
                                                           _request_timeout=self.timeout)
        except ApiException as e:
            if e.status == 404:
                return None, "not_found"
            log.warning("reading %s %s/%s: HTTP %s; the Deployment alone decides", IEC_KIND, namespace,
                        ref.get("name"), e.status)
            return None, "error"
        except Exception as e:  # noqa: BLE001 - connection errors come in several types; never block admission
            log.warning("reading %s %s/%s: %s; the Deployment alone decides", IEC_KIND, namespace, ref.get("name"), e)
            return None, "error"
        return (iec if isinstance(iec, dict) else None), "ok"


def review_response(req: dict[str, Any], cfg: PatchConfig, all_owned: bool = False,
                    iec: dict[str, Any] | None = None) -> dict[str, Any]:
    """The AdmissionReview v1 answer for one request: allowed, with a JSON patch when wanted, except an
    endpoint that would hold a worker/admin l2fs credential (denied, 403). `iec` is the owning
    InferenceEndpointConfig when it could be read."""
    resp: dict[str, Any] = {"uid": req["uid"], "allowed": True}
    kind = req.get("kind") or {}
    obj = req.get("object")
    if not (req.get("operation") in ("CREATE", "UPDATE") and isinstance(obj, dict)
            and kind.get("group") == "apps" and kind.get("kind") == "Deployment"):
        return resp
    name = f"{req.get('namespace') or (obj.get('metadata') or {}).get('namespace')}/" \
           f"{(obj.get('metadata') or {}).get('name') or req.get('name')}"
    if iec is not None and not l2_choice(iec)[0]:
        log.info("leaving %s alone: %s", name, l2_choice(iec)[1])
        resp["_outcome"] = "left_alone"
        return resp
    if wants_patch(obj, all_owned, iec):
        try:
            old = req.get("oldObject") if isinstance(req.get("oldObject"), dict) else None
            ops = plan(obj, cfg, iec, old)  # the IEC (when read) decides the model revision and the KV salt
        except Refused as e:
            log.warning("denying %s: %s", name, e)
            resp.update(allowed=False, status={"code": 403, "reason": "Forbidden",
                                               "message": f"kvtier webhook: {name}: {e}"}, _outcome="refused")
            return resp
        except PatchError as e:
            resp["warnings"] = [f"kvtier webhook: {name} admitted unpatched: {e}"]
            log.warning("not patching %s: %s", name, e)
            resp["_outcome"] = "error"
            return resp
        if ops:
            resp["patchType"] = "JSONPatch"
            resp["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
            log.info("patching %s (%d ops)", name, len(ops))
            resp["_outcome"] = "patched"
        else:
            resp["_outcome"] = "unchanged"
    return resp


def create_app(cfg: PatchConfig, all_owned: bool = False, iec_reader: IecReader | None = None) -> FastAPI:
    """FastAPI app with POST /mutate, GET /healthz and GET /metrics."""
    app = FastAPI(title="kvtier operator-patch webhook", docs_url=None, redoc_url=None, openapi_url=None)
    registry = CollectorRegistry()
    reviews = Counter("kvtier_webhook_reviews", "AdmissionReviews answered, by outcome",
                      ["outcome"], registry=registry)
    lookups = Counter("kvtier_webhook_iec_lookups", "Owning InferenceEndpointConfig reads, by result",
                      ["result"], registry=registry)

    def answer(req: dict[str, Any]) -> dict[str, Any]:
        iec = None
        obj = req.get("object")
        if iec_reader is not None and isinstance(obj, dict) and (req.get("kind") or {}).get("kind") == "Deployment" \
                and req.get("operation") in ("CREATE", "UPDATE"):
            iec, result = iec_reader.get(obj, req.get("namespace") or (obj.get("metadata") or {}).get("namespace") or "")
            lookups.labels(result).inc()
        return review_response(req, cfg, all_owned, iec)

    @app.post("/mutate")
    async def mutate(request: Request) -> Response:
        try:
            req = parse_review(await request.body())
        except BadReview as e:
            reviews.labels("bad_request").inc()
            return JSONResponse({"error": f"malformed AdmissionReview: {e}"}, status_code=400)
        resp = await asyncio.to_thread(answer, req)  # the IEC read is a blocking client call
        reviews.labels(resp.pop("_outcome", "ignored")).inc()
        return JSONResponse({"apiVersion": REVIEW_API, "kind": "AdmissionReview", "response": resp})

    @app.get("/healthz")
    async def healthz() -> Response:
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def main(argv: list[str] | None = None) -> int:
    """Serve the webhook over HTTPS until killed."""
    p = argparse.ArgumentParser(prog="kvtier webhook", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8443)
    p.add_argument("--tls-cert", required=True, help="PEM certificate (chain) served to the API server")
    p.add_argument("--tls-key", required=True, help="PEM private key")
    p.add_argument("--all-owned", action="store_true",
                   help="patch every InferenceEndpointConfig-owned Deployment, not only opted-in ones")
    p.add_argument("--k8s-api", default=None, help="API server URL for IEC reads (default: in-cluster, then "
                   "kubeconfig)")
    p.add_argument("--no-iec-lookup", action="store_true",
                   help="do not read the owning InferenceEndpointConfig (the Deployment alone decides)")
    p.add_argument("--log-level", default="info")
    add_config_args(p)
    ns = p.parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        p.error(str(e))
    for path in (ns.tls_cert, ns.tls_key):
        try:
            open(path, "rb").close()
        except OSError as e:
            print(f"kvtier webhook: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import uvicorn

    log.info("serving https://%s:%d/mutate mode=%s fingerprint=%s", ns.host, ns.port, cfg.mode, cfg.fingerprint())
    reader = None if ns.no_iec_lookup else IecReader.connect(ns.k8s_api)
    uvicorn.run(create_app(cfg, ns.all_owned, reader), host=ns.host, port=ns.port, ssl_certfile=ns.tls_cert,
                ssl_keyfile=ns.tls_key, log_level=ns.log_level.lower(), timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
