"""What the kubelet does to a container's env and argv before the program sees them, for tests that hand a
rendered or webhook-patched container to its real consumer (LMCache's config loader, vLLM's CLI parser).

Rules (Kubernetes "Define dependent environment variables" and third_party/forked/golang/expansion, which
this follows byte for byte):
* envFrom sources first (in order, values taken as they are: no expansion), then `env` entries in order;
  a later entry of the same name replaces the earlier one.
* an `env` entry's `value` is expanded against the variables defined before it (envFrom + earlier entries);
  `valueFrom` results (fieldRef, configMapKeyRef, secretKeyRef) are taken as they are.
* command and args are expanded against the container's final env.
* `$(NAME)` -> its value when defined, else left as the literal `$(NAME)`; `$$` -> `$` (so `$$(NAME)` is the
  literal `$(NAME)`); `$` before anything else stays; an unclosed `$(` stays as written.
"""

from __future__ import annotations

from typing import Any


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion.Expand with the kubelet's mapping (undefined names stay `$(NAME)`)."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1:]
            if rest[0] == "$":  # escaped operator
                out.append("$")
                advance = 1
            elif rest[0] == "(":
                close = rest.find(")", 1)
                if close == -1:  # incomplete reference: kept, scanning resumes after "$("
                    out.append("$(")
                    advance = 1
                else:
                    name = rest[1:close]
                    out.append(env[name] if name in env else f"$({name})")
                    advance = close + 1
            else:
                out.append("$" + rest[0])
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


def container_env(c: dict[str, Any], *, configmaps: dict[str, dict[str, str]] | None = None,
                  secrets: dict[str, dict[str, str]] | None = None,
                  fields: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the kubelet gives container `c`. `fields`: fieldRef paths (spec.nodeName, status.podIP)
    to values. A reference to a missing ConfigMap/Secret/key raises KeyError (the pod would not start)."""
    configmaps, secrets, fields = configmaps or {}, secrets or {}, fields or {}
    env: dict[str, str] = {}
    for src in c.get("envFrom") or []:
        prefix = str(src.get("prefix") or "")
        if "configMapRef" in src:
            data = configmaps[src["configMapRef"]["name"]]
        else:
            data = secrets[src["secretRef"]["name"]]
        for k, v in data.items():
            env[prefix + k] = str(v)
    for e in c.get("env") or []:
        name = e["name"]
        if "valueFrom" in e:
            ref = e["valueFrom"]
            if "fieldRef" in ref:
                env[name] = fields[ref["fieldRef"]["fieldPath"]]
            elif "configMapKeyRef" in ref:
                env[name] = configmaps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
            elif "secretKeyRef" in ref:
                env[name] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
            else:
                raise KeyError(f"env {name}: unsupported valueFrom {ref}")
        else:
            env[name] = expand(str(e.get("value", "")), env)
    return env


def container_argv(c: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args after expansion (what the container's entrypoint receives when both are set)."""
    return [expand(str(w), env) for w in (c.get("command") or []) + (c.get("args") or [])]
