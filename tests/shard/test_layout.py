"""A variable of any shape cut into one flat, zero-padded shard per replica and put back."""

import numpy as np
import pytest
import tensorflow as tf

from framework.shard import Layout


@pytest.mark.parametrize("shape", [(), (1,), (5,), (3, 4), (7, 3, 2), (2, 8)])
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
def test_the_shards_of_any_shape_gather_back_into_the_value(shape, replicas):
    layout = Layout(shape, replicas)
    value = tf.reshape(tf.range(1, layout.size + 1, dtype=tf.float32), shape)
    shards = [layout.shard(value, i) for i in range(replicas)]
    assert all(s.shape == (layout.shard_size,) for s in shards)
    assert layout.padded_size == replicas * layout.shard_size >= layout.size
    assert layout.padded_size - layout.size < replicas  # at most one short row of padding
    gathered = tf.concat(shards, axis=0)
    np.testing.assert_array_equal(layout.whole(gathered), value)
    # The padding is zeros: an optimizer's update leaves it zero, and the gathered value
    # ignores it whatever it holds.
    np.testing.assert_array_equal(gathered[layout.size :], 0)


def test_a_shard_index_may_be_a_tensor_as_a_replica_id_is():
    layout = Layout((5,), 2)
    value = tf.constant([1.0, 2.0, 3.0, 4.0, 5.0])
    np.testing.assert_array_equal(layout.shard(value, tf.constant(1)), [4.0, 5.0, 0.0])
