#!/usr/bin/env bash
# Builds the router's image from the Containerfile at the repository root, with podman.
# `make image` and tests/test_image.py both build through here, so they build alike.
#
#   deploy/image/build.sh [--base IMAGE] [--tag TAG] [--ca FILE]
#
#   --base IMAGE   the Python base (BASE_IMAGE; default docker.io/library/python:3.11-slim)
#   --tag TAG      the image's name (default localhost/kvrouter:latest)
#   --ca FILE      a CA bundle for pip behind a TLS-intercepting proxy, passed as the build
#                  secret "ca": pip uses it, no layer keeps it (default: CA_BUNDLE, else none)
#
# The build steps use the host's network: pip reaches the package index from them, and
# podman's default bridge puts them on a private range that may not reach it. Installs
# nothing itself (`make podman` installs podman and runc). CONTAINERS_CONF defaults to
# deploy/image/containers.conf (runc, lower ulimits). Prints the tag on its last line.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
BASE="docker.io/library/python:3.11-slim"
TAG="localhost/kvrouter:latest"
CA="${CA_BUNDLE:-}"
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --ca) CA="$2"; shift 2 ;;
    *) echo "unknown argument: $1 (usage: head of $0)" >&2; exit 2 ;;
  esac
done
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"
command -v podman >/dev/null || { echo "podman is missing: \`make podman\` installs it" >&2; exit 127; }

SECRET=()
if [ -n "$CA" ]; then
  [ -r "$CA" ] || { echo "CA bundle $CA is not a readable file" >&2; exit 2; }
  SECRET=(--secret "id=ca,src=$CA")
fi
podman build --network host --build-arg "BASE_IMAGE=$BASE" "${SECRET[@]}" -t "$TAG" -f "$REPO/Containerfile" "$REPO" >&2
echo "$TAG"
