"""Start real torch.distributed processes for a test, bounded in time.

`launch(worker, world_size)` spawns ``world_size`` processes on loopback (gloo on
CPU), runs ``worker(rank, world_size)`` in each, and returns what every rank returned
(tensors, numbers, strings, nested in lists/dicts), in rank order. A worker that
raises fails the launch with its traceback; one that hangs (a collective no other
rank joins) fails it after ``timeout_s`` instead of blocking the suite.

Workers do not assert: they compute and return, and the tests compare (so each test
fails on its own). A worker runs many scenarios per launch because starting
processes (importing torch) is what costs time on a small machine.
"""

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60


class LaunchError(RuntimeError):
    """A distributed worker raised, died, or ran past its time limit."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, worker, world_size, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        torch.manual_seed(1234)
        result = worker(rank, world_size)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        # Make the traceback reach the parent even if the others hang in a collective.
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def launch(worker, world_size: int, timeout_s: float = 120.0, preload: Sequence[str] = ()):
    """Run ``worker(rank, world_size)`` on ``world_size`` gloo ranks; per-rank results.

    ``preload``: modules slow to import (Megatron Core takes seconds) that the ranks
    then share: they are imported once, by multiprocessing's fork server, from which
    the ranks are forked. (Not forked from this process: after torch ran multi-threaded
    here, a forked child hangs in its thread pools.)"""
    start_method = "spawn"
    if preload:
        mp.set_forkserver_preload(list(preload))
        start_method = "forkserver"
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(worker, world_size, _free_port(), out_dir),
                                 nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise LaunchError(f"{worker.__name__} on {world_size} ranks ran past "
                                      f"{timeout_s:.0f} s (a hang?)" + _errors(out_dir))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            raise LaunchError(f"{worker.__name__} on {world_size} ranks failed:\n{err}"
                              + _errors(out_dir)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _errors(out_dir) -> str:
    text = ""
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".err"):
            with open(os.path.join(out_dir, name)) as f:
                text += f"\n--- {name}:\n{f.read()}"
    return text


class CollectiveCounter:
    """Counts calls of ``torch.distributed.all_reduce`` (fp8.py and the TP helpers call
    it through the module attribute), recording (op, group size, numel) of each."""

    def __init__(self):
        self.calls = []
        self._real = None

    def __enter__(self):
        self._real = dist.all_reduce
        real = self._real

        def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self.calls.append((str(op), dist.get_world_size(group), tensor.numel()))
            return real(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real
        return False

    def take(self):
        out, self.calls = self.calls, []
        return out
