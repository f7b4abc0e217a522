#!/bin/bash
# PID 1 of a rig guest once /init has switched to the host's root. It wires the node's underlay
# (eth0, Soft-RoCE rxe0 on it, the host-gw route to the other node's pod CIDR), says "ready" in
# the share, then runs the jobs the host drops into the share, several at a time.
#
# Job protocol (files in $SHARE/node<N>/, all written atomically by rename):
#   host  -> jobs/<id>.job   a bash script; a first line "#rig timeout=<s>" bounds it
#   guest -> out/<id>.stdout, out/<id>.stderr while it runs, then out/<id>.rc (exit status;
#            124 = timed out). Processes a job starts in the background keep running after
#            the job ends; on a timeout the job's whole process group is killed, so start
#            long-lived daemons with setsid.
# Every job gets RIG_NODE, RIG_PEER_NODE, RIG_SHARE, RIG_NODE_DIR, RIG_ADDR, RIG_PEER_ADDR,
# RIG_POD_CIDR, RIG_PEER_POD_CIDR, RIG_RDMA_DEV and FLOWLANE_BIN_DIR in its environment, and the
# guest scripts (node-up.sh, pod-add.sh, pod-del.sh, node-down.sh) on its PATH.
GUEST_DIR=$(cd "$(dirname "$0")" && pwd)
# The guest scripts (node-up.sh, pod-add.sh, ...) are on every job's PATH.
export PATH=$GUEST_DIR:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8
arg() { sed -n "s/.*$1=\([^ ]*\).*/\1/p" /proc/cmdline; }
export RIG_NODE RIG_PEER_NODE RIG_SHARE RIG_NODE_DIR RIG_ADDR RIG_PEER_ADDR RIG_POD_CIDR RIG_PEER_POD_CIDR RIG_RDMA_DEV
RIG_NODE=$(arg rig.node)
RIG_SHARE=$(arg rig.share)
RIG_PEER_NODE=$((3 - RIG_NODE))
RIG_NODE_DIR=$RIG_SHARE/node$RIG_NODE
RIG_ADDR=192.168.47.$RIG_NODE
RIG_PEER_ADDR=192.168.47.$RIG_PEER_NODE
RIG_POD_CIDR=10.47.$RIG_NODE.0/24
RIG_PEER_POD_CIDR=10.47.$RIG_PEER_NODE.0/24
RIG_RDMA_DEV=rxe0
FLOWLANE_BIN_DIR=$(arg rig.bindir)
[ "$FLOWLANE_BIN_DIR" = none ] && FLOWLANE_BIN_DIR=
export FLOWLANE_BIN_DIR
up() { cut -d' ' -f1 /proc/uptime; }
say() { echo "@@RIG node$RIG_NODE $* (uptime $(up))"; }
mkdir -p "$RIG_NODE_DIR"/{jobs,run,out,logs}
exec >>"$RIG_NODE_DIR/logs/agent.log" 2>&1 </dev/null
hostname "node$RIG_NODE"

# ---- the underlay: eth0 on the QEMU socket netdev (the other guest is the only thing on it)
setup() {
  ip link set lo up || return 1
  modprobe virtio_net || return 1
  local i=0
  until ip link show eth0 >/dev/null 2>&1; do i=$((i + 1)); [ $i -gt 100 ] && return 1; sleep 0.1; done
  sysctl -qw net.ipv6.conf.all.accept_dad=0 net.ipv6.conf.default.accept_dad=0 net.ipv6.conf.eth0.accept_dad=0
  sysctl -qw net.ipv4.ip_forward=1
  ip addr add "$RIG_ADDR/24" dev eth0 && ip link set eth0 up || return 1
  # host-gw: the other node's pods are behind its underlay address.
  ip route add "$RIG_PEER_POD_CIDR" via "$RIG_PEER_ADDR" dev eth0 || return 1
  # rdma_rxe does crypto_alloc_shash("crc32") without a module dependency: load it first.
  modprobe crc32_generic && modprobe rdma_rxe && modprobe ib_uverbs && modprobe rdma_ucm || return 1
  rdma link add "$RIG_RDMA_DEV" type rxe netdev eth0 || return 1
  modprobe bridge && modprobe veth || return 1
  ulimit -l unlimited
}
if setup; then
  say "underlay ready"
  { echo "uptime=$(up)"; echo "kernel=$(uname -r)"; } > "$RIG_NODE_DIR/.ready.tmp"
  mv "$RIG_NODE_DIR/.ready.tmp" "$RIG_NODE_DIR/ready"
else
  say "setup FAILED"
  echo "setup failed, see logs/agent.log" > "$RIG_NODE_DIR/failed"
  ip addr; ip link; lsmod
fi

# ---- job loop
run_job() { # id
  local id=$1 t script="$RIG_NODE_DIR/run/$1.sh"
  t=$(sed -n '1s/^#rig timeout=\([0-9]*\).*/\1/p' "$script"); t=${t:-600}
  (cd /root 2>/dev/null || cd /
   timeout -k 5 "$t" bash "$script" >"$RIG_NODE_DIR/out/$id.stdout" 2>"$RIG_NODE_DIR/out/$id.stderr" </dev/null
   echo $? > "$RIG_NODE_DIR/out/.$id.rc"
   mv "$RIG_NODE_DIR/out/.$id.rc" "$RIG_NODE_DIR/out/$id.rc") &
}
shopt -s nullglob
# A pipe nobody writes to: `read -t` on it is a sleep without forking /bin/sleep, which matters
# under TCG, where every fork+exec of the idle loop costs guest CPU (and so host CPU).
mkfifo /run/rig-nap && exec {nap}<>/run/rig-nap
while :; do
  for f in "$RIG_NODE_DIR"/jobs/*.job; do
    id=$(basename "$f" .job)
    mv "$f" "$RIG_NODE_DIR/run/$id.sh" 2>/dev/null && run_job "$id"
  done
  [ -e "$RIG_NODE_DIR/poweroff" ] && { say "poweroff requested"; sync; busybox poweroff -f; }
  read -r -t 0.1 -u "$nap" _   # bash reaps every child on SIGCHLD, also the orphans PID 1 adopts
done
