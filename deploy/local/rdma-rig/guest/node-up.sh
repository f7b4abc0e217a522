#!/bin/bash
# Makes the guest a flowlane node, laid out like a real one (the guest's / is an overlay, so the
# default paths are private to this guest):
#   /etc/cni/net.d/10-flowlane.conflist   pod CIDR $RIG_POD_CIDR on bridge flrig0 (the plugin
#                                         creates it at the first ADD)
#   /opt/cni/bin/flowlane                 -> $FLOWLANE_BIN_DIR/flowlane
#   /etc/flowlane/nodes.json              the two-node table (podCIDRs, underlay, rdma, lanePort)
#   /etc/flowlane/lane.key                the rig's lane key (--lane-key-file), mode 0600: the same
#                                         fixed test key on both guests (a test rig, not a secret)
#   /var/lib/flowlane                     state dir (pod registry), IPAM in /var/lib/flowlane/ipam
#   /run/flowlane/flowlaned.sock          flowlaned's socket; its pid in /run/flowlane/flowlaned.pid;
#                                         NODE_NAME=node<N> in its environment (its name in nodes.json)
#   $RIG_NODE_DIR/logs/flowlaned.log      the daemon's log (readable on the host)
# Run as a rig job (the agent exports RIG_*). Environment:
#   FLOWLANE_BIN_DIR  (required) the host's <target>/release, same path in the guest
#   FLOWLANED_ARGS    extra flowlaned arguments, as shell words in which the RIG_* variables
#                     expand, e.g. '--lane-listen "$RIG_ADDR:7471" --nodes /etc/flowlane/nodes.json'
#   RIG_LANE_PORT     lanePort written to nodes.json (default 7471)
#   FLOWLANE_LOG      daemon log filter (default info)
#   NO_DAEMON=1       configure only, do not start flowlaned
# Idempotent: a running daemon is stopped first (node-down.sh does that too).
set -euo pipefail
: "${FLOWLANE_BIN_DIR:?FLOWLANE_BIN_DIR must name the build dir}" "${RIG_NODE:?run me as a rig job}"
BIN=$FLOWLANE_BIN_DIR
for b in flowlane flowlaned; do [ -x "$BIN/$b" ] || { echo "node-up: $BIN/$b missing (cargo build --release --workspace)" >&2; exit 1; }; done
STATE=/var/lib/flowlane
RUNDIR=/run/flowlane
SOCK=$RUNDIR/flowlaned.sock
LANE_PORT=${RIG_LANE_PORT:-7471}
PREFIX=${RIG_POD_CIDR%.0/24}
mkdir -p /etc/cni/net.d /opt/cni/bin /etc/flowlane "$STATE/ipam" "$RUNDIR" "$RIG_NODE_DIR/logs"
ln -sf "$BIN/flowlane" /opt/cni/bin/flowlane

cat > /etc/cni/net.d/10-flowlane.conflist <<EOF
{
  "cniVersion": "1.1.0",
  "name": "flowlane-rig",
  "plugins": [
    {
      "type": "flowlane",
      "bridge": "flrig0",
      "isGateway": true,
      "isDefaultGateway": true,
      "stateDir": "$STATE",
      "daemonSocket": "$SOCK",
      "logFile": "$RIG_NODE_DIR/logs/cni.log",
      "ipam": {
        "type": "flowlane",
        "ranges": [[{ "subnet": "$RIG_POD_CIDR", "gateway": "$PREFIX.1" }]],
        "dataDir": "$STATE/ipam"
      }
    }
  ]
}
EOF

# The RoCE v2 GID of the underlay address: the index of ::ffff:<underlay> in rxe0's table. Both
# guests build rxe0 the same way, so the peer's entry sits at the same index.
gid_index() {
  local want want_hex i g
  want_hex=$(printf '%02x%02x:%02x%02x' $(echo "$1" | tr . ' '))
  want="0000:0000:0000:0000:0000:ffff:$want_hex"
  for g in /sys/class/infiniband/$RIG_RDMA_DEV/ports/1/gids/*; do
    i=${g##*/}
    [ "$(cat "$g" 2>/dev/null)" = "$want" ] && [ "$(cat /sys/class/infiniband/$RIG_RDMA_DEV/ports/1/gid_attrs/types/$i 2>/dev/null)" = "RoCE v2" ] && { echo "$i"; return; }
  done
  return 1
}
GIDX=$(gid_index "$RIG_ADDR") || { echo "node-up: no RoCE v2 GID for $RIG_ADDR on $RIG_RDMA_DEV" >&2; exit 1; }
node_entry() { # node underlay podcidr
  cat <<EOF
    {"name": "node$1", "podCIDRs": ["$3"], "underlay": "$2", "lanePort": $LANE_PORT,
     "rdma": {"device": "$RIG_RDMA_DEV", "port": 1, "gidIndex": $GIDX, "gid": "::ffff:$2",
              "linkLayer": "Ethernet", "activeMtu": 1024}}
EOF
}
{ echo '{"nodes": ['
  node_entry 1 192.168.47.1 10.47.1.0/24; echo ','
  node_entry 2 192.168.47.2 10.47.2.0/24
  echo ']}'; } > /etc/flowlane/nodes.json
cp /etc/flowlane/nodes.json "$RIG_NODE_DIR/nodes.json"
(umask 077; printf 'flowlane rdma rig lane key: a fixed test key, not a secret\n' > /etc/flowlane/lane.key)

# Stop a daemon from an earlier node-up.
if [ -f "$RUNDIR/flowlaned.pid" ]; then
  old=$(cat "$RUNDIR/flowlaned.pid")
  kill "$old" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$old" 2>/dev/null || true
  rm -f "$RUNDIR/flowlaned.pid" "$SOCK"
fi
[ -n "${NO_DAEMON:-}" ] && { echo "node$RIG_NODE configured (no daemon)"; exit 0; }

# setsid: the daemon outlives this job (and its timeout's process group).
eval "extra=(${FLOWLANED_ARGS:-})"
NO_COLOR=1 NODE_NAME=node$RIG_NODE FLOWLANE_LOG=${FLOWLANE_LOG:-info} setsid "$BIN/flowlaned" --state-dir "$STATE" --socket "$SOCK" "${extra[@]}" \
  >>"$RIG_NODE_DIR/logs/flowlaned.log" 2>&1 </dev/null &
pid=$!
echo "$pid" > "$RUNDIR/flowlaned.pid"
for _ in $(seq 1 300); do
  [ -S "$SOCK" ] && { echo "node$RIG_NODE up: flowlaned pid $pid, socket $SOCK, pods $RIG_POD_CIDR, gid index $GIDX"; exit 0; }
  kill -0 "$pid" 2>/dev/null || { echo "node-up: flowlaned exited at start:" >&2; tail -20 "$RIG_NODE_DIR/logs/flowlaned.log" >&2; exit 1; }
  sleep 0.1
done
echo "node-up: flowlaned did not open $SOCK within 30 s" >&2
exit 1
