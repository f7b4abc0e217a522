#!/bin/bash
# Removes a pod added by pod-add.sh: CNI DEL through the real plugin (with the ADD result as
# prevResult, as libcni does), then the network namespace.
#   pod-del.sh NAME
set -euo pipefail
NAME=${1:?usage: pod-del.sh NAME}
CONF=/etc/cni/net.d/10-flowlane.conflist
prev=/run/flowlane-rig/pods/$NAME.json
netconf=$(jq -c '{cniVersion, name} + .plugins[0]' "$CONF")
[ -f "$prev" ] && netconf=$(echo "$netconf" | jq -c --slurpfile p "$prev" '. + {prevResult: $p[0]}')
rc=0
echo "$netconf" | CNI_COMMAND=DEL CNI_CONTAINERID="rig-$NAME" CNI_NETNS="/var/run/netns/$NAME" \
  CNI_IFNAME=eth0 CNI_PATH=/opt/cni/bin:/usr/lib/cni /opt/cni/bin/flowlane || rc=$?
ip netns del "$NAME" 2>/dev/null || true
rm -f "$prev" "$RIG_NODE_DIR/pods/$NAME.json"
exit $rc
