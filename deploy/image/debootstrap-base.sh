#!/usr/bin/env bash
# A Python base image made locally with debootstrap, so that the router's image can be built
# and tested with no container registry: only a Debian mirror is needed, once per suite.
#
#   deploy/image/debootstrap-base.sh [SUITE]     # prints the base's tag (default suite: bookworm)
#
# Cached twice, so warm runs take a second: as a podman image (localhost/kvrouter-base:SUITE-KEY)
# and as a root-filesystem tarball in KVROUTER_IMAGE_CACHE (default ~/.cache/kvrouter-image),
# which outlives `podman system reset` and is what a CI cache keeps. KEY hashes the suite, the
# mirror and the package list, so changing either makes a new base instead of reusing a stale one.
#
# Needs root (debootstrap chroots; podman runs rootful), debootstrap and podman: `make podman`
# installs them. Installs nothing itself. CONTAINERS_CONF defaults to deploy/image/containers.conf.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SUITE="${1:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python3-venv brings ensurepip (pip into the image's venv); passwd brings useradd (not in
# minbase's essential set). Nothing else: pip installs the router's dependencies in the build.
PACKAGES="python3,python3-venv,passwd"
CACHE="${KVROUTER_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter-image}"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$HERE/containers.conf}"

for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "$tool is missing: \`make podman\` installs it" >&2; exit 127; }
done

KEY="$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" | sha256sum | cut -c1-12)"
TAG="localhost/kvrouter-base:$SUITE-$KEY"
TARBALL="$CACHE/base-$SUITE-$KEY.tar"

mkdir -p "$CACHE"
# Two builds at once (make image next to make test) would debootstrap into the same place.
exec 9>"$CACHE/.lock"
flock 9

if podman image exists "$TAG"; then
  echo "$TAG"
  exit 0
fi

if [ ! -s "$TARBALL" ]; then
  ROOT="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$ROOT" "$TARBALL.tmp"' EXIT
  echo "debootstrap $SUITE from $MIRROR (once per suite; then cached in $TARBALL)" >&2
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >&2 \
    || { cat "$ROOT/debootstrap/debootstrap.log" >&2 2>/dev/null; exit 1; }
  # What an image does not need: downloaded .debs, package lists, docs. resolv.conf and
  # hostname are the build host's; podman provides its own at run time.
  rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* \
    "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/etc/resolv.conf "$ROOT"/etc/hostname
  tar --numeric-owner --xattrs -C "$ROOT" -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
fi

podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' --change 'CMD ["/usr/bin/python3"]' \
  --quiet --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE $MIRROR" "$TARBALL" "$TAG" >/dev/null
echo "$TAG"
