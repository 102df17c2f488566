#!/usr/bin/env bash
# Install the toolchains of the cross-language clients and build the C one.
#
#   bash tests/interop/setup.sh          install what is missing, build, verify
#   bash tests/interop/setup.sh --check  install nothing: build if possible, verify
#
# Idempotent: a second run installs nothing and rebuilds only a changed source.
# Needs (installed when missing, as root or through sudo):
#   Debian: gcc libc6-dev pkg-config libzmq3-dev libmsgpack-dev (msgpack-c 4),
#           nodejs npm (only when no node >= 18 is on PATH)
#   npm:    tests/interop/js/package-lock.json (zeromq 6, @msgpack/msgpack 3)
# Exits non-zero, saying what is missing, if anything cannot be installed or built.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="$HERE/build"
JS="$HERE/js"
CHECK=0
[[ "${1:-}" == "--check" ]] && CHECK=1

say() { echo "interop setup: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

as_root() {
    if [[ $(id -u) -eq 0 ]]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo -n "$@"
    else die "need root (or sudo) to run: $*"
    fi
}

APT_UPDATED=0
apt_install() {
    (( CHECK )) && die "missing: $* (run bash tests/interop/setup.sh to install)"
    command -v apt-get >/dev/null 2>&1 || die "missing $* and no apt-get to install them"
    if (( ! APT_UPDATED )); then
        as_root apt-get update -qq || die "apt-get update failed"
        APT_UPDATED=1
    fi
    say "apt-get install $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
        || die "apt-get install $* failed"
}

# --- C: compiler, libzmq, msgpack-c --------------------------------------------------
need=()
command -v gcc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
if command -v pkg-config >/dev/null 2>&1; then
    pkg-config --exists libzmq || need+=(libzmq3-dev)
    pkg-config --exists msgpack || need+=(libmsgpack-dev)
else
    need+=(libzmq3-dev libmsgpack-dev)
fi
(( ${#need[@]} )) && apt_install "${need[@]}"
pkg-config --exists libzmq msgpack || die "pkg-config does not find libzmq and msgpack after installing them"

mkdir -p "$BUILD"
SRC="$HERE/c/zkv_client.c"
BIN="$BUILD/zkv_client"
if [[ ! -x "$BIN" || "$SRC" -nt "$BIN" || "$0" -nt "$BIN" ]]; then
    say "building $BIN"
    # shellcheck disable=SC2046
    gcc -std=c11 -O2 -Wall -Wextra -Werror -o "$BIN.tmp" "$SRC" $(pkg-config --cflags --libs libzmq msgpack) \
        || die "building the C client failed"
    mv "$BIN.tmp" "$BIN"
fi
set +e; "$BIN" >/dev/null 2>&1; rc=$?; set -e
[[ $rc -eq 2 ]] || die "$BIN does not run (exit $rc, expected the usage exit 2)"

# --- JavaScript: node >= 18, npm, the locked packages ---------------------------------
node_ok() {
    command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
        && node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 18 ? 0 : 1)'
}
node_ok || apt_install nodejs npm
node_ok || die "node >= 18 and npm are needed (found: $(node --version 2>/dev/null || echo none))"

LOCK="$JS/package-lock.json"
STAMP="$JS/node_modules/.zkv-lock.sha256"
want="$(sha256sum "$LOCK" | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]]; then
    (( CHECK )) && die "tests/interop/js/node_modules is missing or stale (run bash tests/interop/setup.sh)"
    say "npm ci in $JS"
    # --ignore-scripts: zeromq@6 ships prebuilt binaries; its install script would
    # only try to compile from source, which needs a toolchain download.
    (cd "$JS" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) || die "npm ci failed"
    echo "$want" > "$STAMP"
fi
(cd "$JS" && node --input-type=module -e '
    const zmq = await import("zeromq");
    const { encode, decode } = await import("@msgpack/msgpack");
    if (decode(encode({ v: 1 })).v !== 1) process.exit(1);
    new zmq.Dealer({ linger: 0 }).close();
') || die "the JavaScript packages do not load (zeromq prebuilt binary for node $(node --version)?)"

say "ok: $BIN, node $(node --version), zeromq $(cd "$JS" && node -p 'require("zeromq/package.json").version')"
