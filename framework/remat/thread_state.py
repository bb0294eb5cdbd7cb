"""Per-thread settings that hold for the duration of a `with` block: which tag the next op gets,
whether regions run as plain calls, whether `checkpoint_name` tags. Per thread, because each
replica of a `tf.distribute` strategy traces its step in a thread of its own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class ThreadSetting(Generic[V]):
    """A value per thread: `default` until a `with setting.set(value):` block sets it there."""

    def __init__(self, default: V):
        self._local = threading.local()
        self._default = default

    @property
    def value(self) -> V:
        return getattr(self._local, "value", self._default)

    @contextlib.contextmanager
    def set(self, value: V) -> Iterator[None]:
        previous = self.value
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = previous
