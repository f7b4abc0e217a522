#!/bin/bash
# Boots one rig guest in the foreground (exec's QEMU, so the caller's child pid IS qemu's pid).
#   boot-node.sh NODE RUN_DIR PORT PEER_PORT
# with KERNEL, INITRD, MODDIR in the environment (from prepare.sh) and RIG_BIN_DIR (the host's
# <target>/release, exported to guest jobs as FLOWLANE_BIN_DIR). RUN_DIR/share is the
# writable 9p share (the job protocol lives in RUN_DIR/share/node<N>/); the serial console goes
# to RUN_DIR/console-node<N>.log.
#
# The two guests' NICs are joined by QEMU's socket netdev over one TCP connection on the host's
# 127.0.0.1 only (no tap, no slirp: neither guest can reach anything but the other): node 1
# listens on its PORT, node 2 connects to PEER_PORT. TCP, not UDP, because the wire must not drop
# frames, as a RoCE fabric with PFC does not: with UDP a starved guest's socket overflowed under
# load, and this kernel's Soft-RoCE recovers from lost frames wrongly (a write-with-immediate
# completed twice, or the responder NAKed a retried write as an invalid request), which failed
# the RDMA links of whatever test ran while the host was busy. Over TCP a slow guest slows its
# peer down instead (QEMU stops reading the socket while the guest's receive ring is full). The host's / is shared read-only; nothing in the guest can
# write to the host except the share.
#
# Environment knobs: RIG_MEM (default 1024 MiB), RIG_SMP (default 1 vCPU: two guests on a
# 2-core host), RIG_ACCEL (tcg; kvm only where nested KVM really works, see docs/rdma.md).
set -euo pipefail
NODE=$1 RUN=$2 PORT=$3 PEER_PORT=$4
HERE=$(cd "$(dirname "$0")" && pwd)
: "${KERNEL:?}" "${INITRD:?}" "${MODDIR:?}"
SHARE=$RUN/share
mkdir -p "$SHARE/node$NODE"
ACCEL=${RIG_ACCEL:-tcg}
if [ "$ACCEL" = kvm ]; then ACCEL_OPTS=(-accel kvm -cpu host)
# tb-size=256 MiB: QEMU 7.2 defaults the TCG translation cache to 1 GiB of RSS per guest.
else ACCEL_OPTS=(-accel tcg,thread=multi,tb-size=256 -cpu max); fi
if [ "$NODE" = 1 ]; then
  NETDEV="socket,id=n0,listen=127.0.0.1:$PORT"
else
  # QEMU's connect does not retry: wait until node 1's QEMU listens (it does before its guest boots).
  for _ in $(seq 1 300); do
    ss -Hltn "sport = :$PEER_PORT" | grep -q LISTEN && break
    sleep 0.1
  done
  NETDEV="socket,id=n0,connect=127.0.0.1:$PEER_PORT"
fi
APPEND="console=ttyS0 quiet panic=-1 rdinit=/init rig.node=$NODE rig.share=$SHARE rig.agent=$HERE/guest/agent.sh rig.moddir=$MODDIR rig.bindir=${RIG_BIN_DIR:-none}"
exec qemu-system-x86_64 "${ACCEL_OPTS[@]}" \
  -name "flowlane-rig-node$NODE" -nodefaults -no-user-config -no-reboot \
  -m "${RIG_MEM:-1024}" -smp "${RIG_SMP:-1}" \
  -display none -monitor none -serial "file:$RUN/console-node$NODE.log" \
  -kernel "$KERNEL" -initrd "$INITRD" -append "$APPEND" \
  -fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap" \
  -device "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot" \
  -fsdev "local,id=rig,path=$SHARE,security_model=none,multidevs=remap" \
  -device "virtio-9p-pci,fsdev=rig,mount_tag=rig" \
  -netdev "$NETDEV" \
  -device "virtio-net-pci,netdev=n0,mac=52:54:00:47:00:0$NODE,romfile=" \
  </dev/null
