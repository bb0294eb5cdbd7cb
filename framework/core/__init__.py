"""What every part shares: errors, argument checks, file access (local or gs://), and the one
module each for the private TensorFlow/Keras APIs (`tf_internals`) and jax/libtpu APIs
(`jax_internals`)."""
