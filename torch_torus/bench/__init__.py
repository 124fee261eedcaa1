"""Benchmark torch.distributed collectives with nccl-tests' columns, several backends side by side.

    torchrun --nproc-per-node 4 -m torch_torus.bench -b 4K -e 64M -f 2 --check \\
        --backends "torus:allreduce=ring,chunk_bytes=1M;torus:allreduce=torus;gloo"

Every contender (a backend, optionally with torus options) gets its own process group, created
with dist.new_group after a gloo bootstrap group. The contender "mpi" is not a torch backend: it
calls MPI's collectives through mpi4py on numpy views of the same tensors (in place where torch's
call is), timed the same way, so that torus, gloo and MPI compare in one run:

    mpiexec -n 4 python -m torch_torus.bench --backends "torus;gloo;mpi"

Sizes are measured one after another and, at each size, every contender in turn, so drift of the
machine over a long run hits all contenders alike and the ratios printed at the end compare like
with like.

Columns follow nccl-tests (all_reduce_perf and friends):
  size   bytes of the largest buffer one rank passes (for allgather the gathered output,
         for reduce_scatter and alltoall the whole input)
  count  the element count the collective is called with: the whole tensor for allreduce and
         broadcast, one rank's share for allgather, reduce_scatter and alltoall
  time   mean time of one call over --iters calls, the slowest rank's; with --timing osu, each
         call timed alone after a barrier (OSU's osu_allreduce), the median over calls of the
         slowest rank's time, beside OSU's latency columns (avg lat, min lat, max lat: each
         rank's mean per call, averaged, least and most over ranks)
  algbw  size / time;  busbw = algbw x the collective's bus factor: 2(n-1)/n for allreduce,
         (n-1)/n for allgather, reduce_scatter and alltoall, 1 for broadcast
  #wrong elements that differ from the expected result, summed over ranks (--check)
  %copy  with --device cuda: busbw as a percentage of the device-to-device copy bandwidth of rank
         0's GPU, measured once at the start (a 256 MiB copy_, bytes read + written per second)
  %mem   on one CPU host: the memory's bound as a percentage of the time. The bound is the
         bytes the collective must read and write at least once (2·n·S for allreduce: every
         rank's input read, its output written) over the host's memory bandwidth, measured at
         the start by min(cores, ranks) ranks copying 64 MiB each at once (memory_bound.py)

The script runs under torchrun or any launcher that sets the env:// variables (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE), and under mpiexec (MPICH or Open MPI) and Slurm's srun, from
whose variables torch_torus.launch derives them; both as `-m torch_torus.bench` and as a plain
path to this folder (`python path/to/torch_torus/bench`).

The modules, in the order a run uses them: contenders (who is measured: the --backends grammar,
the backends' import, the mpi contender), collectives (the calls, their buffers and expected
results), timing (rounds and --timing, shared with torch_torus.tune; the GPU's copy bandwidth),
measure (one size: every contender timed and checked), report (table, summary, JSON, plot),
sizes (4K, 64M), cli (the command line).
"""
