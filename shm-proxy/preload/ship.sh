#!/usr/bin/env bash
# Builds the preload library that flowlane ships (the image, install.sh, every
# test): linked against glibc 2.17's symbol versions, so that it loads in any
# image with glibc 2.17 or later (CentOS 7, UBI 8, Ubuntu 20.04, Amazon Linux
# 2, CUDA and TensorFlow images), not only in images as new as the build
# machine. `cargo zigbuild` links with zig's glibc stubs of that version;
# rustc's own code generation is the same as a plain `cargo build`.
#
# Output: <target>/release/shipped/libflowlane_preload.so (a directory cargo
# never writes: a later `cargo build` cannot replace it with the build
# machine's glibc).
# Needs cargo-zigbuild and zig: .ci/install-deps puts both (PyPI packages
# cargo-zigbuild and ziglang) in /opt/flowlane-zig.
set -euo pipefail
cd "$(dirname "$0")/../.."
FLOOR=2.17
TRIPLE=x86_64-unknown-linux-gnu
export PATH="/opt/flowlane-zig/bin:$PATH"
if ! command -v cargo-zigbuild >/dev/null; then
  echo "ship.sh: cargo-zigbuild not found (run .ci/install-deps, or: pip install cargo-zigbuild ziglang)" >&2
  exit 1
fi
TARGET_DIR=${CARGO_TARGET_DIR:-target}
cargo zigbuild --release --locked -p flowlane-preload --target "$TRIPLE.$FLOOR"
mkdir -p "$TARGET_DIR/release/shipped"
# Copy, then rename: a process that has the old file mapped keeps it.
cp "$TARGET_DIR/$TRIPLE/release/libflowlane_preload.so" "$TARGET_DIR/release/shipped/.libflowlane_preload.so.new"
mv -f "$TARGET_DIR/release/shipped/.libflowlane_preload.so.new" "$TARGET_DIR/release/shipped/libflowlane_preload.so"
echo "ship.sh: $TARGET_DIR/release/shipped/libflowlane_preload.so (glibc >= $FLOOR)"
# The injection's init-container probe and the no-op object ship beside it.
bash deploy/probe/build.sh
