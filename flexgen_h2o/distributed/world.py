"""The torchrun world of this process: ranks, nodes, the process groups, and which rank died.

torchrun exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and the rendezvous address; Slurm, Kubernetes
and a plain `torchrun --nnodes` all start a job the same way. Control messages (the job's prompts, the resume
state, the final gather) go over gloo on every machine; a pipeline's hidden states go over NCCL between GPUs.
When a rank dies, torchrun stops the others with SIGTERM (or their next collective fails): each survivor stops
with one line that names the dead rank where it can see it (a rank on its own node, by pid).
"""
from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Mapping

# how long a collective waits for a slow rank before failing: a data-parallel rank that drew a longer share
# waits at the final gather for the others (torchrun stops the job at once when one dies, so this bounds a hang,
# not a normal wait)
COLLECTIVE_TIMEOUT = timedelta(hours=12)


class RankStopped(BaseException):
    """This rank was stopped because another rank failed (torchrun's SIGTERM). A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""


@dataclass
class World:
    rank: int
    size: int
    local_rank: int              # rank on this node
    local_size: int              # ranks on this node: they share its RAM, disk and cores
    peers: list[tuple[str, int]] = field(default_factory=list)     # (host, pid) of every rank, after init
    data_group: Any = None       # the group hidden states travel in (NCCL between GPUs, else the default)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def init(self, *, cuda: bool) -> "World":
        """Join the job's process group (gloo, for control), and on GPUs a NCCL group for hidden states."""
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        self.data_group = dist.new_group(backend="nccl") if cuda else None
        gathered: list = [None] * self.size
        dist.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
        self.peers = [tuple(p) for p in gathered]
        signal.signal(signal.SIGTERM, _on_sigterm)
        return self

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()

    def dead_ranks(self) -> list[int]:
        """Ranks on this node whose process is gone (a zombie counts as gone)."""
        host = socket.gethostname()
        return [r for r, (h, pid) in enumerate(self.peers) if h == host and r != self.rank and not _alive(pid)]

    def stopped_line(self, output: str | None) -> str:
        """The one line a survivor prints when the job lost a rank."""
        dead = self.dead_ranks()
        who = (", ".join(f"rank {r} (pid {self.peers[r][1]})" for r in dead) + (" died" if dead else "")
               if dead else "another rank failed (on another node: torchrun's report names it)")
        again = f"; rerun the same command to finish {output}: results already written are kept" if output else ""
        return f"error: {who}; rank {self.rank} stopped{again}"

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value on every rank (pickled)."""
        import torch.distributed as dist
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list:
        """Every rank's value, on every rank, in rank order; also the job's barrier."""
        import torch.distributed as dist
        out: list = [None] * self.size
        dist.all_gather_object(out, value)
        return out


def world_from_env(env: Mapping[str, str] = os.environ) -> World | None:
    """The world torchrun describes, or None for a plain single-process run (no WORLD_SIZE, or 1)."""
    size = int(env.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return None
    rank = int(env["RANK"])
    return World(rank=rank, size=size, local_rank=int(env.get("LOCAL_RANK", rank)),
                 local_size=int(env.get("LOCAL_WORLD_SIZE", size)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _on_sigterm(signum: int, frame: Any) -> None:
    raise RankStopped("stopped by SIGTERM")
