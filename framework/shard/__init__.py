"""Training state sharded across data-parallel replicas (ZeRO, FSDP), for tf.distribute.

Data parallelism keeps a full copy of the weights, the gradients and the optimizer state on every
replica: 16 bytes per parameter with AdamW in float32. Sharding keeps 1/N of some of them per
replica, at three levels (DeepSpeed's ZeRO stages, PyTorch FSDP's full sharding):

- `optimizer`: each replica stores and updates 1/N of every optimizer slot and of the weights'
  master copy; the updated parts are all-gathered into the replicated weights.
- `gradients`: the gradients are reduce-scattered (summed, each replica keeping its part) instead
  of all-reduced, so no replica holds the summed gradients.
- `weights`: the weights too are stored as parts only; a layer's weights are all-gathered where
  the layer reads them, inside the step, and gathered again when a checkpointed block is
  recomputed.

The parts are flat cuts of each variable (`layout`), kept in replica-local variables
(`variables`); the optimizer is built on them (`optimizer`); checkpoints hold whole values, the
same as an unsharded run's (`checkpoint`); the collectives run between a step's XLA programs on
CPUs and GPUs, or inside one program on TPUs (`collectives`). See docs/sharding.md.
"""

from framework.shard.checkpoint import WholeValue, checkpoint_view
from framework.shard.collectives import Collectives, ReplicaCollectives, XlaCollectives
from framework.shard.layout import Layout
from framework.shard.optimizer import build_on_shards, check_shardable
from framework.shard.state import LEVELS, ShardedState, WeightReads
from framework.shard.variables import ShardedVariables, WholeValues, assign_whole, host_of

__all__ = [
    "LEVELS",
    "Collectives",
    "Layout",
    "ReplicaCollectives",
    "ShardedState",
    "ShardedVariables",
    "WeightReads",
    "WholeValue",
    "WholeValues",
    "XlaCollectives",
    "assign_whole",
    "build_on_shards",
    "check_shardable",
    "checkpoint_view",
    "host_of",
]
