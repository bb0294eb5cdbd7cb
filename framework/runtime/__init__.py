"""The devices a step runs on: the `Runtime` (strategy, devices, compiler flags, precision),
strategy helpers (`distribute`), XLA and libtpu flags (`xla`) and FLOP counts and peaks
(`flops`)."""

from framework.runtime.devices import Runtime

__all__ = ["Runtime"]
