#!/bin/bash
# Prepares what the Soft-RoCE rig boots, in a cache that survives test runs:
#   - Debian's kernel package (linux-image-<abi>-amd64, NOT -cloud: that flavour has neither
#     rdma_rxe nor 9p), fetched with `apt-get download`, extracted with `dpkg -x` (nothing is
#     installed on the host), `depmod`ed (the .deb ships no modules.dep), and its bzImage payload
#     decompressed to an ELF vmlinux that QEMU boots through the PVH entry point (saves ~3 s of
#     a TCG boot);
#   - a tiny initramfs: static busybox, /init (guest/init) and only the modules /init needs to
#     mount the host's / over 9p (virtio-pci, 9p, overlay). Every other module is loaded later by
#     modprobe from the extracted tree, which the guest sees through the same 9p share.
#
# Prints KEY=VALUE lines (KVER, KERNEL, INITRD, MODDIR) for boot-node.sh / the Rust harness.
#
# Environment:
#   FLOWLANE_RDMA_VM_CACHE   cache dir (default /var/cache/flowlane-rdma-vm)
#   FLOWLANE_RDMA_VM_KERNEL  kernel package to pin (default linux-image-6.1.0-57-amd64). When apt
#                            no longer offers it and it is not cached, the ABI that Debian's
#                            linux-image-amd64 meta package currently depends on is used instead.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${FLOWLANE_RDMA_VM_CACHE:-/var/cache/flowlane-rdma-vm}
PIN=${FLOWLANE_RDMA_VM_KERNEL:-linux-image-6.1.0-57-amd64}
log() { echo "prepare: $*" >&2; }
die() { echo "prepare: error: $*" >&2; exit 1; }

for tool in qemu-system-x86_64 dpkg apt-get depmod cpio xz busybox flock; do
  command -v "$tool" >/dev/null || die "$tool not found (run .ci/install-deps)"
done
[ -x /bin/busybox ] || die "/bin/busybox missing (package busybox-static)"
file_is_static() { ! ldd "$1" >/dev/null 2>&1; }
file_is_static /bin/busybox || die "/bin/busybox is not static (install busybox-static)"

mkdir -p "$CACHE/debs"
# One preparer at a time (several test binaries or people may boot rigs at once).
exec 9>"$CACHE/.lock"
flock 9

kernel_ready() { [ -f "$CACHE/kernel-${1#linux-image-}/.ready" ]; }

# apt-get download into the cache; refresh the package lists once if apt does not know it.
download() {
  local pkg=$1
  ls "$CACHE/debs/${pkg}_"*.deb >/dev/null 2>&1 && return 0
  log "downloading $pkg"
  local tmp
  tmp=$(mktemp -d "$CACHE/debs/.dl.XXXXXX")
  if ! (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1); then
    if [ -z "${REFRESHED:-}" ]; then
      log "apt-get download $pkg failed; running apt-get update"
      apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null 2>&1 || true
      REFRESHED=1
    fi
    (cd "$tmp" && apt-get download -q "$pkg" >/dev/null 2>&1) || { rm -rf "$tmp"; return 1; }
  fi
  mv "$tmp"/*.deb "$CACHE/debs/" && rmdir "$tmp"
}

extract() {
  local pkg=$1 kver=${1#linux-image-}
  local root="$CACHE/kernel-$kver"
  rm -rf "$root" && mkdir -p "$root"
  dpkg -x "$CACHE/debs/${pkg}_"*.deb "$root"
  depmod -b "$root" "$kver"
  # PVH boot: the ELF vmlinux inside the bzImage (xz payload) boots straight from QEMU's -kernel.
  local vmlinuz="$root/boot/vmlinuz-$kver" off
  off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$vmlinuz" | head -1 | cut -d: -f1 || true)
  if [ -n "$off" ]; then tail -c +$((off + 1)) "$vmlinuz" | xz -dc > "$root/vmlinux" 2>/dev/null || true; fi
  [ "$(head -c 4 "$root/vmlinux" 2>/dev/null | od -An -c | tr -d ' ')" = '177ELF' ] || rm -f "$root/vmlinux"
  touch "$root/.ready"
}

PKG=$PIN
if ! kernel_ready "$PKG"; then
  if ! download "$PKG"; then
    META=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    [ -n "$META" ] || die "cannot download $PIN and apt does not resolve linux-image-amd64 (apt-get update?)"
    log "$PIN is not offered any more; falling back to $META"
    PKG=$META
    kernel_ready "$PKG" || download "$PKG" || die "cannot download $PKG"
  fi
  kernel_ready "$PKG" || extract "$PKG"
fi
KVER=${PKG#linux-image-}
KROOT="$CACHE/kernel-$KVER"
MODDIR="$KROOT/lib/modules/$KVER"
KERNEL="$KROOT/vmlinux"
[ -f "$KERNEL" ] || KERNEL="$KROOT/boot/vmlinuz-$KVER"

# ---------------------------------------------------------------- initramfs (keyed by content)
# The key covers everything the image is built from (the module set follows from the kernel
# version and WANT), so a cached run never has to walk modules.dep (slow in bash on a busy host).
WANT="virtio_pci 9pnet_virtio 9p overlay"
KEY=$( { echo "$KVER $WANT"; cat "$HERE/guest/init"; sha256sum /bin/busybox; } | sha256sum | cut -c1-16)
INITRD="$CACHE/initramfs-$KVER-$KEY.cpio"
if [ ! -s "$INITRD" ]; then
  log "building $(basename "$INITRD")"
  declare -A DEPS=() PATHOF=() SEEN=()
  while IFS=: read -r path deps; do
    n=$(basename "$path" .ko); n=${n//-/_}; PATHOF[$n]=$path; DEPS[$path]=$deps
  done < "$MODDIR/modules.dep"
  ORDER=()
  visit() { local p=$1 d; [ -n "${SEEN[$p]:-}" ] && return; SEEN[$p]=1
    for d in ${DEPS[$p]}; do visit "$d"; done; ORDER+=("$p"); }
  for m in $WANT; do
    # built into the kernel (modules.builtin) needs nothing
    if [ -z "${PATHOF[$m]:-}" ]; then
      grep -q "/${m//_/[-_]}.ko$" "$MODDIR/modules.builtin" 2>/dev/null || die "module $m not in $KVER"
      continue
    fi
    visit "${PATHOF[$m]}"
  done
  IRD=$(mktemp -d "$CACHE/.initramfs.XXXXXX")
  mkdir -p "$IRD"/{bin,sbin,etc,proc,sys,dev,tmp,run,newroot,lower,rw,lib/modules}
  cp /bin/busybox "$IRD/bin/busybox"
  : > "$IRD/etc/modules.load"
  for p in "${ORDER[@]}"; do
    mkdir -p "$IRD/lib/modules/$(dirname "$p")"; cp "$MODDIR/$p" "$IRD/lib/modules/$p"
    echo "$p" >> "$IRD/etc/modules.load"
  done
  install -m 755 "$HERE/guest/init" "$IRD/init"
  # Uncompressed: under TCG, decompressing in the guest costs more than reading a bigger file.
  (cd "$IRD" && find . | cpio -o -H newc --quiet) > "$INITRD.tmp" && mv "$INITRD.tmp" "$INITRD"
  rm -rf "$IRD"
  # Older initramfs builds of this kernel (another guest/init) are no longer used; leave the
  # ones from the last hour to rigs of another checkout that may be booting right now.
  find "$CACHE" -maxdepth 1 -name "initramfs-$KVER-*.cpio" ! -path "$INITRD" -mmin +60 -delete
fi
echo "KVER=$KVER"
echo "KERNEL=$KERNEL"
echo "INITRD=$INITRD"
echo "MODDIR=$MODDIR"
