#!/bin/bash
# Runs a program in a pod of this rig node, as the deploy layer would: in the pod's network
# namespace, and with --lane also with flowlane's preload library and the node daemon's socket.
#   pod-exec.sh [--lane] NAME PROGRAM [ARGS...]
set -euo pipefail
lane=
if [ "${1:-}" = --lane ]; then lane=1; shift; fi
NAME=${1:?usage: pod-exec.sh [--lane] NAME PROGRAM [ARGS...]}; shift
[ $# -gt 0 ] || { echo "pod-exec: no program" >&2; exit 2; }
if [ -n "$lane" ]; then
  : "${FLOWLANE_BIN_DIR:?}"
  exec ip netns exec "$NAME" env LD_PRELOAD="$FLOWLANE_BIN_DIR/libflowlane_preload.so" \
    FLOWLANE_SOCKET=/run/flowlane/flowlaned.sock "$@"
fi
exec ip netns exec "$NAME" "$@"
