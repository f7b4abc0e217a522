#!/bin/bash
# Marginal ADD cost of flowlane in chained mode: the reference bridge+host-local ADD, then
# flowlane chained given bridge's result as prevResult, each timed, N pods.
set -eu
N=${N:-40}; FL=/work/main/target/release/flowlane; STATE=$(mktemp -d); IPAM=$(mktemp -d)
BR='{"cniVersion":"1.0.0","name":"dpbench","type":"bridge","bridge":"dpbr0","isGateway":true,"ipam":{"type":"host-local","dataDir":"'$IPAM'","ranges":[[{"subnet":"10.234.200.0/24"}]]}}'
ns=(); tb=(); tf=()
for i in $(seq $N); do n=dpbench$i; ip netns add $n; ns+=($n); done
for i in $(seq $N); do
  n=dpbench$i
  t0=$(date +%s%N)
  res=$(echo "$BR" | CNI_COMMAND=ADD CNI_CONTAINERID=c$i CNI_NETNS=/run/netns/$n CNI_IFNAME=eth0 CNI_PATH=/usr/lib/cni /usr/lib/cni/bridge)
  t1=$(date +%s%N)
  conf=$(jq -n --argjson p "$res" --arg s "$STATE" '{cniVersion:"1.0.0",name:"dpbench",type:"flowlane",mode:"chained",stateDir:$s,daemonSocket:($s+"/none.sock"),prevResult:$p}')
  t1b=$(date +%s%N)
  echo "$conf" | CNI_COMMAND=ADD CNI_CONTAINERID=c$i CNI_NETNS=/run/netns/$n CNI_IFNAME=eth0 CNI_PATH=/usr/lib/cni $FL >/dev/null
  t2=$(date +%s%N)
  tb+=($(( (t1-t0)/1000 ))); tf+=($(( (t2-t1b)/1000 )))
done
for i in $(seq $N); do
  n=dpbench$i
  echo "$BR" | CNI_COMMAND=DEL CNI_CONTAINERID=c$i CNI_NETNS=/run/netns/$n CNI_IFNAME=eth0 CNI_PATH=/usr/lib/cni /usr/lib/cni/bridge >/dev/null
  ip netns del $n
done
ip link del dpbr0 2>/dev/null || true
rm -rf "$STATE" "$IPAM"
p50() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {print a[int(NR*0.5+0.5)]/1000}'; }
p99() { printf '%s\n' "$@" | sort -n | awk '{a[NR]=$1} END {i=int(NR*0.99+0.5); if(i<1)i=1; print a[i]/1000}'; }
echo "sequential ADD, ms, $N pods: bridge+host-local p50 $(p50 "${tb[@]}") p99 $(p99 "${tb[@]}"); flowlane chained step p50 $(p50 "${tf[@]}") p99 $(p99 "${tf[@]}")"
