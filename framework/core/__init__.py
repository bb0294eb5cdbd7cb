"""What every part shares: errors, argument checks, file access (local or gs://), the supported
TensorFlow releases (`releases`), each TPU generation's figures (`tpu_generations`), and the one
module each for the private TensorFlow/Keras APIs (`tf_internals`) and jax/libtpu APIs
(`jax_internals`). `errors`, `releases` and `tpu_generations` import only the standard library:
the launchers (`launch/`) use them on a machine without TensorFlow."""
