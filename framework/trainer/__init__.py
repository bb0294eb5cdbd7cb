"""The trainer: `Trainer` composes a runtime, a model, the compiled step (`train_step`), data and
the actions run after each loop (`actions`), from `TrainerSettings` (`settings`, bound by gin as
`Trainer.*`); `losses`, `optim`, `summaries` and `warm_start` are its parts.

`Trainer` is imported on first use, so that importing one part (`framework.trainer.losses`, as
the gin registrations do) does not build the whole trainer first.
"""

__all__ = ["Trainer"]


def __getattr__(name: str):
    if name == "Trainer":
        from framework.trainer.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'framework.trainer' has no attribute {name!r}")
