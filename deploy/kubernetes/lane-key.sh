#!/bin/sh
# Makes the cluster's lane key: the Secret flowlane-lane-key (key "key": 48 random bytes,
# base64) that every flowlaned proves at the set-up of a cross-node lane link
# (docs/security.md). The DaemonSet mounts it at /etc/flowlane-lane/key, mode 0400.
# Run after `kubectl apply -k deploy/kubernetes` (the namespace must exist). An existing key is
# kept; ROTATE=1 replaces it (then `kubectl -n flowlane-system rollout restart ds/flowlane-node`:
# daemons with different keys refuse each other until all have restarted, and their pods'
# cross-node connections stay on TCP meanwhile).
set -eu
NS=${NS:-flowlane-system}
NAME=${NAME:-flowlane-lane-key}
if kubectl -n "$NS" get secret "$NAME" >/dev/null 2>&1 && [ "${ROTATE:-0}" != 1 ]; then
  echo "lane key $NS/$NAME exists (ROTATE=1 replaces it)"
  exit 0
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
umask 077
head -c 48 /dev/urandom | base64 | tr -d '\n' > "$dir/key"
kubectl -n "$NS" create secret generic "$NAME" --from-file=key="$dir/key" \
  --dry-run=client -o yaml | kubectl apply -f -
echo "lane key $NS/$NAME provisioned"
