#!/bin/bash
# dead-peer matrix; each run bounded by timeout. usage: run_kill.sh [reps] [killwait]
cd "$(dirname "$0")"
REPS=${1:-1}; KW=${2:-20}
for rep in $(seq $REPS); do
for p in "tcp;ofi_rxm" "udp;ofi_rxd" shm; do
  for t in kill-recv kill-send kill-write; do
    echo "##### rep$rep $p $t"
    /usr/bin/time -f "wall %e s" timeout 200 ./ofi_probe --prov "$p" --np 2 --test $t --killwait $KW 2>&1 | grep -v '^\(caps\|mode\|mr_\|addr\|inject\|max\|tx\|progress\|thread\|msg_order\|resource\|ep name\|provider\|==\)'
  done
done
done
