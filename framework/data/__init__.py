"""tf.data input pipelines with static shapes; no gin, no trainer."""
