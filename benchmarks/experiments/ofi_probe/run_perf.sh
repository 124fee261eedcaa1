#!/bin/bash
# perf matrix: 3 reps per provider, np=2, sizes up to 64 MiB
cd "$(dirname "$0")"
for rep in 1 2 3; do for p in "tcp;ofi_rxm" "udp;ofi_rxd" shm; do
  echo "##### rep$rep $p  load: $(cut -d' ' -f1 /proc/loadavg)"
  timeout 200 ./ofi_probe --prov "$p" --np 2 --test perf 2>&1 | grep "pingpong\|fi_write\|check\|rank"
done; done
echo "##### shm FI_SHM_DISABLE_CMA=1"; FI_SHM_DISABLE_CMA=1 timeout 200 ./ofi_probe --prov shm --np 2 2>&1 | grep "pingpong\|fi_write\|check"
echo "##### tcp progress=auto  load: $(cut -d' ' -f1 /proc/loadavg)"; timeout 200 ./ofi_probe --prov "tcp;ofi_rxm" --progress auto --maxsize 65536 2>&1 | grep "pingpong\|fi_write"
