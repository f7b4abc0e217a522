#!/usr/bin/env bash
# Builds what the injection's init containers use, next to the shipped preload
# library (shm-proxy/preload/ship.sh runs this):
#   <target>/release/shipped/flowlane-probe       static (musl, no libc needed in
#                                                 the image), runs in the pod's image
#   <target>/release/shipped/libflowlane_noop.so  an ELF shared object with no code
#                                                 and no DT_NEEDED: glibc and musl
#                                                 both load it, and it does nothing
# With zig's C compiler (the same /opt/flowlane-zig as ship.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/opt/flowlane-zig/bin:$PATH"
TARGET_DIR=${CARGO_TARGET_DIR:-target}
OUT="$TARGET_DIR/release/shipped"
mkdir -p "$OUT"
zigcc() { python3 -m ziglang cc "$@"; }
if ! python3 -m ziglang version >/dev/null 2>&1; then
  echo "probe/build.sh: zig not found (run .ci/install-deps, or: pip install ziglang)" >&2
  exit 1
fi
zigcc -target x86_64-linux-musl -static -Os -s -Wall -Wextra -Werror \
  -o "$OUT/.flowlane-probe.new" deploy/probe/probe.c
zigcc -target x86_64-linux-musl -shared -nostdlib -fPIC -s -Wl,--hash-style=both \
  -Wl,-soname,libflowlane_noop.so -o "$OUT/.libflowlane_noop.so.new" deploy/probe/noop.c
mv -f "$OUT/.flowlane-probe.new" "$OUT/flowlane-probe"
mv -f "$OUT/.libflowlane_noop.so.new" "$OUT/libflowlane_noop.so"
echo "probe/build.sh: $OUT/flowlane-probe $OUT/libflowlane_noop.so"
