#!/bin/bash
# Undoes node-up.sh and every pod-add.sh: deletes the pods through the plugin, stops flowlaned.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
for p in /run/flowlane-rig/pods/*.json; do
  [ -e "$p" ] || continue
  "$HERE/pod-del.sh" "$(basename "$p" .json)" || echo "node-down: DEL $(basename "$p" .json) failed" >&2
done
if [ -f /run/flowlane/flowlaned.pid ]; then
  pid=$(cat /run/flowlane/flowlaned.pid)
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
  rm -f /run/flowlane/flowlaned.pid /run/flowlane/flowlaned.sock
fi
echo "node$RIG_NODE down"
