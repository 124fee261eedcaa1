"""THE table of per-backend deviations from the contract the tests check.

The tests encode what a backend must do (tests/reference.py: results equal a one-process
reference; invalid (op, dtype) pairs raise an error naming the op).  A backend that cannot
meet the contract somewhere is listed here, explicitly, with what it does instead:

* an entry with ``observed`` turns that test into an xfail, but only after running it and
  checking that every problem it reports matches ``observed`` (so a different failure still
  fails, and a backend that starts passing turns the entry into a failure: "stale entry");
* an entry with ``skip=True`` is for features that do not apply to that backend at all
  (e.g. torus-specific options): the test is skipped with the entry's reason.

"torus" has no entry: it must meet the whole contract.  Entries for "gloo" exist so that
``TORUS_TEST_BACKENDS=gloo`` validates the tests against a known-good implementation.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import FrozenSet, List, Optional

F = frozenset
FLOATS = F({"float32", "float64", "float16", "bfloat16"})
NONFLOATS = F({"int8", "int16", "int32", "int64", "uint8", "bool"})
ALL_COLLECTIVES_BUT_P2P = ("all_reduce*", "reduce*", "broadcast*", "all_gather*", "gather*",
                           "scatter*", "all_to_all*")


@dataclasses.dataclass(frozen=True)
class Gap:
    backend: str
    what: tuple  # fnmatch patterns of test keys ("all_reduce", "all_reduce.noncontig.*", ...)
    reason: str
    dtypes: Optional[FrozenSet[str]] = None  # None: any
    ops: Optional[FrozenSet[str]] = None  # None: any
    observed: str = ""  # regex each reported problem must match (xfail), unless skip
    skip: bool = False
    min_world_size: int = 1

    def applies(self, backend, what, dtype=None, op=None, world_size=None) -> bool:
        return (backend.partition("+")[0] == self.backend
                and any(fnmatch.fnmatchcase(what, w) for w in self.what)
                and (self.dtypes is None or dtype in self.dtypes)
                and (self.ops is None or op in self.ops)
                and (self.min_world_size <= 1 or (world_size or 0) >= self.min_world_size))

    def explains(self, problems: List[str]) -> bool:
        return bool(problems) and all(re.search(self.observed, p, re.S) for p in problems)

    def __str__(self) -> str:
        return f"[{self.backend}] {self.reason}"


GAPS: List[Gap] = [
    # ---------------------------------------------------------------- gloo (torch 2.13)
    Gap("gloo", ALL_COLLECTIVES_BUT_P2P, dtypes=F({"int16"}),
        reason="gloo has no int16 in its collectives",
        observed=r"Invalid scalar type"),
    Gap("gloo", ("all_reduce*", "reduce", "reduce_scatter*"), dtypes=FLOATS,
        ops=F({"PREMUL_SUM"}),
        reason="gloo does not implement PREMUL_SUM",
        observed=r"Cannot use ReduceOp\.PREMUL_SUM with Gloo"),
    Gap("gloo", ("all_reduce*", "reduce", "reduce_scatter*"), dtypes=NONFLOATS,
        ops=F({"AVG"}),
        reason="gloo rejects AVG on integer/bool tensors, but its error does not name AVG "
               "(\"result type Float can't be cast to the desired output type ...\")",
        observed=r"does not name the op.*can't be cast to the desired output type"),
    Gap("gloo", ("all_reduce.noncontig.strided", "all_reduce.noncontig.columns",
                 "all_reduce.noncontig.rows_strided"),
        reason="gloo's allreduce ignores the strides of a non-dense view: it reduces and "
               "writes numel() elements from data_ptr() as if contiguous (wrong result)",
        observed=r"elements wrong|changed outside the view", min_world_size=2),
    Gap("gloo", ("broadcast.noncontig",),
        reason="gloo's broadcast ignores the strides of a non-dense tensor (wrong result)",
        observed=r"elements wrong", min_world_size=2),
    Gap("gloo", ("scatter.noncontig",),
        reason="gloo's scatter writes a non-dense output as if contiguous (wrong result)",
        observed=r"elements wrong"),
    Gap("gloo", ("all_gather_into_tensor.stack", "reduce_scatter_tensor.stack"),
        reason="gloo supports only the concatenated form of all_gather_into_tensor / "
               "reduce_scatter_tensor, not the stacked one ([world_size, *shape])",
        observed=r"invalid tensor size|Check failed: outputShape\[0\] \* worldSize"),
    Gap("gloo", ("all_to_all.uneven", "cuda.all_to_all.uneven"),
        reason="gloo's all_to_all (list form) needs every tensor to have the same size",
        observed=r"ProcessGroupGloo::alltoall: invalid tensor size", min_world_size=2),
    Gap("gloo", ("async_collectives",),
        reason="gloo's reduce_scatter_tensor work never reports is_completed() after wait()",
        observed=r"reduce_scatter_tensor: work\.is_completed\(\) is False"),
    Gap("gloo", ("timeout",),
        reason="gloo times out with a plain RuntimeError from its transport (\"Timed out "
               "waiting 3000ms for recv operation\"), not a DistBackendError naming the "
               "collective",
        observed=r"not DistBackendError|does not name the collective"),
    # ------------------------------------------------- timeouts (test_timeouts.py), gloo
    Gap("gloo", ("timeouts.*.raises_dist_backend_error", "timeouts.*.names_sequence_number",
                 "timeouts.*.names_absent_rank", "timeouts.all_reduce.*.names_collective",
                 "timeouts.broadcast.names_collective", "timeouts.all_gather.names_collective",
                 "timeouts.barrier.names_collective", "timeouts.work_wait_timeout.names_collective"),
        reason="gloo times out with a plain RuntimeError from its transport (\"Timed out waiting 2000ms "
               "for recv operation to complete\"; Work.wait(timeout): \"Operation timed out!\") that names "
               "no collective (send and recv say \"send/recv operation\"), sequence number or rank; it does "
               "fail fast afterwards (\"Application timeout caused pair closure\")",
        observed=r"not DistBackendError|does not name"),
    # ------------------------------------------ bad arguments (test_bad_arguments*.py), gloo
    Gap("gloo", ("bad_args.*.band_float", "bad_args.all_reduce.premul_sum_int", "bad_args.all_reduce.uint16",
                 "bad_args.all_reduce.avg_int"),
        reason="gloo checks the (op, dtype) pair and the dtype only once the collective is queued: the "
               "caller raises (naming the op but not the dtype, or for AVG on integers only \"result type "
               "Float can't be cast\", after writing the tensor), and its group is out of step: the next "
               "collective times out or the process dies",
        observed=r"after the bad call failed|does not name the argument|changed the tensor|died|the case failed"),
    Gap("gloo", ("bad_args.*overlapping*",),
        reason="gloo accepts an output whose elements share memory (expand()): it runs the collective, "
               "then fails writing the result (\"more than one element of the written-to tensor refers "
               "to a single memory location\") or corrupts it, and the group is out of step or the "
               "process dies",
        observed=r"was accepted|changed the tensor|single memory location|after the bad call|the case failed"),
    Gap("gloo", ("bad_args.recv.overlapping", "bad_args.irecv.overlapping"),
        reason="gloo refuses every non-contiguous receive buffer (\"input tensor has to be contiguous\"), "
               "an expanded one included, without saying that its elements share memory",
        observed=r"input tensor has to be contiguous"),
    Gap("gloo", ("bad_args.all_to_all_single.splits_*", "bad_args.all_to_all_single.negative_split",
                 "bad_args.all_to_all_single.not_divisible"),
        reason="gloo checks all_to_all_single's split sizes only once the collective is queued: the caller "
               "raises (\"Split sizes doesn't match total dim 0 size\", or a bare enforce failure), and its "
               "group is out of step afterwards",
        observed=r"after the bad call failed|does not name the argument|the case failed"),
    Gap("gloo", ("bad_args.reduce_scatter.wrong_size",),
        reason="gloo's reduce_scatter size check is a bare CHECK (\"outputs[0].sizes().vec() == "
               "inputs[0][i].sizes().vec() (4 vs. 5)\") that names no index",
        observed=r"does not name the argument.*Check failed"),
    Gap("gloo", ("bad_args.all_reduce.timeout_negative", "bad_args.barrier.timeout_*"),
        reason="gloo takes a zero or negative per-call timeout as given: the call times out at once "
               "(\"Timed out waiting -1000ms for recv\") and closes its connections, breaking the group",
        observed=r"does not name the argument.*Timed out waiting|after the bad call failed"),
    # ------------------------------------------- sparse all_reduce (test_sparse_allreduce.py), gloo
    Gap("gloo", ("sparse_all_reduce",), dtypes=F({"float16", "bool"}),
        reason="gloo sums sparse tensors with torch's sparse add, which has no CPU kernel for float16 "
               "or bool (\"cadd_sparse\" not implemented for 'Half' / 'Bool')",
        observed=r"not implemented for '(Half|Bool)'"),
    Gap("gloo", ("sparse_all_reduce.mismatch",),
        reason="gloo refuses sparse tensors of different sizes without naming the size or the ranks "
               "(\"Sparse dimensions do not match\")",
        observed=r"does not name the size: Sparse dimensions do not match"),
    Gap("gloo", ("sparse_all_reduce",), dtypes=F({"int16"}),
        reason="gloo has no int16 in its collectives",
        observed=r"Invalid scalar type"),
    # ------------------------------------------- monitored_barrier (test_monitored_barrier.py), gloo
    Gap("gloo", ("monitored_barrier.late_rank",),
        reason="gloo's rank 0 does not tell the others that its monitored barrier failed: a rank that comes "
               "after rank 0 gave up sends its arrival to a closed connection and raises gloo's transport "
               "error (\"Connection closed by peer\"), not monitored_barrier's",
        observed=r"raised, but not .*Connection closed by peer"),
    Gap("gloo", ("timeouts.work_wait_timeout.has_torch_words",),
        reason="gloo's Work.wait(timeout) raises \"Operation timed out!\", which lacks the words torch's own "
               "tests match (\" (Timed out|closed|timeout) \")",
        observed=r"lacks the words torch matches.*Operation timed out!"),
    Gap("gloo", ("bad_args.send.dst_*", "bad_args.isend.dst_too_big", "bad_args.recv.src_too_big",
                 "bad_args.irecv.src_too_big", "bad_args.batch_isend_irecv.peer_too_big"),
        reason="gloo does not check a send's dst or a receive's src against the group: it waits in the "
               "store for a rank that does not exist (until the group's timeout)",
        observed=r"the case failed.*HUNG"),
    Gap("gloo", ("bad_args.send.uint16",),
        reason="gloo sends any dtype (uint16 is fine for a byte copy), and its send waits for the "
               "receiver, which here never comes",
        observed=r"the case failed.*HUNG"),
    Gap("gloo", ("bad_args.batch_isend_irecv.bad_second_op",),
        reason="gloo has no coalescing, so torch posts a batch's ops one by one and the good isend before "
               "the refused op has gone out (torus checks a batch whole before posting any of it)",
        observed=r"the case failed.*HUNG|ring (irecv|isend|receive)|after the bad call failed"),
    # ------------------------------------------- CUDA tensors (test_cuda.py, keys "cuda.*"), gloo
    # Read from torch's ProcessGroupGloo sources and backend table; not yet confirmed on a GPU
    # (no GPU run with TORUS_TEST_BACKENDS=gloo so far): correct an entry after the first one.
    Gap("gloo", ("cuda.all_reduce_coalesced",),
        reason="gloo's allreduce_coalesced takes CPU tensors only (\"unsupported device type cuda\"), "
               "on every rank before anything moves",
        observed=r"unsupported device type"),
    Gap("gloo", ("cuda.send_recv", "cuda.isend_irecv", "cuda.batch_isend_irecv"), skip=True,
        reason="gloo has no CUDA path for send and recv (torch's backend table: not on GPU): it hands "
               "the tensor's device pointer to its TCP transport"),
    Gap("gloo", ("cuda.reduce",), min_world_size=2,
        reason="gloo's reduce uses every rank's tensor as scratch: a non-root rank's tensor changes "
               "(NCCL and torus leave it as it was; seen on CPU tensors too)",
        observed=r"the tensor changed on non-root rank"),
    Gap("gloo", ("cuda.timeout",),
        reason="gloo times out with a plain RuntimeError from its transport, naming neither the "
               "collective nor the absent rank",
        observed=r"not DistBackendError|does not name"),
    Gap("gloo", ("torus.*",), skip=True,
        reason="torch_torus.Options / TORUS_* settings are specific to the torus backend"),
]


def gap(backend: str, what: str, dtype: Optional[str] = None, op: Optional[str] = None,
        world_size: Optional[int] = None) -> Optional[Gap]:
    """The table entry for this (backend, test key, dtype, op, world size), if any (several
    entries that apply are merged: each problem must then match one of them)."""
    found = [g for g in GAPS if g.applies(backend, what, dtype, op, world_size)]
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    return Gap(backend, (what,), reason="; ".join(g.reason for g in found),
               observed="|".join(f"(?:{g.observed})" for g in found),
               skip=any(g.skip for g in found))


def skip_if_not_applicable(backend: str, what: str) -> None:
    import pytest

    g = gap(backend, what)
    if g is not None and g.skip:
        pytest.skip(str(g))
