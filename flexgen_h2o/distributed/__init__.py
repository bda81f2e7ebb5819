"""Scale-out on torch.distributed, started by torchrun: data-parallel batch jobs (each rank a share of the
prompts, rank 0 merges the parts) and a pipeline of layer stages (hidden states rank to rank)."""
from flexgen_h2o.distributed.world import RankStopped, World, world_from_env

__all__ = ["RankStopped", "World", "world_from_env"]
