"""A Keras optimizer whose state is sharded: built on shards, each slot a shard of its own.

Built on the shards of the weights (`ShardedVariables.shards`), an optimizer makes each slot in
the shape of a shard, and its update runs on every replica on that replica's parts: what an
elementwise optimizer computes for those elements of the whole variables, with 1/N of the
state per device. Optimizers whose update is not elementwise would compute something else on
a part (Adafactor factors its second moments by rows and columns and scales steps by each
weight's RMS; LAMB and LARS scale by each weight's norm): they are refused, by name.
"""

from __future__ import annotations

import keras

from framework.shard.layout import Layout
from framework.shard.variables import ShardedVariables, per_replica_variables

# Optimizers whose update is elementwise, so exact on shards (Keras' own; subclasses too).
ELEMENTWISE = (
    keras.optimizers.Adam,  # and AdamW
    keras.optimizers.SGD,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adamax,
    keras.optimizers.Lion,
)


def check_shardable(optimizer: keras.optimizers.Optimizer) -> None:
    """Raises ValueError unless `optimizer` computes the same on shards as on whole weights."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, ELEMENTWISE):
        supported = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        raise ValueError(
            f"sharded training state needs an elementwise optimizer ({supported}); {name}'s "
            "update reads whole weights or keeps state not shaped like them (factored moments, "
            "per-weight norms or RMS, Nadam's scalar). Use Trainer.shard_state = 'none' with "
            "it, or AdamW"
        )
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            f"{name} was made with use_ema=True, which sharded state does not hold (the "
            "averages would be made for whole weights): use Trainer.shard_state = 'none' with it"
        )
    for clip in ("clipnorm", "global_clipnorm", "clipvalue"):
        if getattr(optimizer, clip, None) is not None:
            raise ValueError(
                f"{name} was made with {clip}=..., which on shards would clip each part apart: "
                "clip with Trainer.clip_norm instead (the global norm over all replicas' parts)"
            )


def build_on_shards(
    optimizer: keras.optimizers.Optimizer, sharded: ShardedVariables
) -> dict[int, Layout]:
    """Builds `optimizer` (made in the strategy's scope, not built yet) for the shards, each
    slot one value per replica; returns the layout of each slot's whole value, by the slot's
    id (the layout of the weight it was made for)."""
    check_shardable(optimizer)
    layouts = dict(zip((id(s) for s in sharded.shards), sharded.layouts))
    slot_layouts: dict[int, Layout] = {}
    make_slot = optimizer.add_variable_from_reference

    def recorded(reference_variable, name=None, initializer="zeros"):
        slot = make_slot(reference_variable, name=name, initializer=initializer)
        slot_layouts[id(slot)] = layouts[id(reference_variable)]
        return slot

    before = {id(v) for v in optimizer.variables}
    optimizer.add_variable_from_reference = recorded
    try:
        with sharded.strategy.scope(), per_replica_variables():
            optimizer.build(sharded.shards)
    finally:
        del optimizer.add_variable_from_reference
    unknown = [
        v.path for v in optimizer.variables if id(v) not in before and id(v) not in slot_layouts
    ]
    if unknown:
        raise ValueError(
            f"{type(optimizer).__name__} keeps state that is not shaped like a weight "
            f"({', '.join(unknown)}): it cannot be sharded; use Trainer.shard_state = 'none'"
        )
    return slot_layouts
