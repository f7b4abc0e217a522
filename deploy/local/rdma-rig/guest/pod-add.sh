#!/bin/bash
# Adds a pod to this rig node the way a container runtime does: a fresh network namespace, then
# the real flowlane plugin exec'd with the CNI environment and the network config on stdin
# (the conflist's single plugin with cniVersion and name, as libcni passes it).
#   pod-add.sh NAME     -> prints the pod's IPv4 address; the CNI result is kept in
#                          /run/flowlane-rig/pods/NAME.json (and $RIG_NODE_DIR/pods/NAME.json)
# Programs then run in the pod with `ip netns exec NAME ...`. Needs node-up.sh first.
set -euo pipefail
NAME=${1:?usage: pod-add.sh NAME}
CONF=/etc/cni/net.d/10-flowlane.conflist
[ -f "$CONF" ] || { echo "pod-add: no $CONF (run node-up.sh first)" >&2; exit 1; }
mkdir -p /run/flowlane-rig/pods "$RIG_NODE_DIR/pods"
ip netns add "$NAME"
ip -n "$NAME" link set lo up
netconf=$(jq -c '{cniVersion, name} + .plugins[0]' "$CONF")
if ! result=$(echo "$netconf" | CNI_COMMAND=ADD CNI_CONTAINERID="rig-$NAME" CNI_NETNS="/var/run/netns/$NAME" \
    CNI_IFNAME=eth0 CNI_PATH=/opt/cni/bin:/usr/lib/cni CNI_ARGS="K8S_POD_NAMESPACE=rig;K8S_POD_NAME=$NAME" \
    /opt/cni/bin/flowlane); then
  echo "pod-add: CNI ADD failed: $result" >&2
  ip netns del "$NAME" || true
  exit 1
fi
echo "$result" > "/run/flowlane-rig/pods/$NAME.json"
echo "$result" > "$RIG_NODE_DIR/pods/$NAME.json"
echo "$result" | jq -r '.ips[] | select(.address | test("^[0-9.]+/")) | .address | split("/")[0]' | head -1
