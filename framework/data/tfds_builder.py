"""Opening a TensorFlow Datasets data set and its splits, with errors that say what to do:
what the image source (`images/tfds.py`) and the text source (`text/tfds_text.py`) share.

TensorFlow Datasets is an optional extra: `pip install 'framework[tfds]'`.
"""

from __future__ import annotations

import tensorflow as tf

from framework.core.errors import MissingDependency


def import_tfds():
    """The `tensorflow_datasets` module, or an error saying how to install it."""
    try:
        import tensorflow_datasets
    except ImportError:
        raise MissingDependency(
            "data.tfds needs TensorFlow Datasets: pip install 'framework[tfds]' "
            "(or pip install tensorflow-datasets)"
        ) from None
    return tensorflow_datasets


def builder(name: str, data_dir: str | None, setting: str = "data.tfds.name"):
    """The TFDS builder of `name`, or an error naming `setting` when there is no such set."""
    tfds = import_tfds()
    try:
        return tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        raise ValueError(
            f"{setting} {name!r} is not a TensorFlow Datasets data set (tfds.list_builders() "
            "lists them)"
        ) from None


def as_dataset(builder, split: str, data_dir: str | None, decoders=None) -> tf.data.Dataset:
    """The split's examples in TFDS's order, or an error saying how to prepare the data set."""
    try:
        return builder.as_dataset(split=split, shuffle_files=False, decoders=decoders)
    except AssertionError as error:  # what TFDS raises for a data set not prepared
        raise ValueError(
            f"TensorFlow Datasets data set {builder.name!r} is not prepared in data_dir "
            f"{data_dir or '~/tensorflow_datasets'}: prepare it once with `tfds build "
            f"{builder.name} --data_dir=...` ({str(error).splitlines()[0][:200]})"
        ) from None


def check_features(builder, keys: dict[str, str], source: str = "data.tfds") -> None:
    """Each key (by its setting's name) is a feature of the data set."""
    features = builder.info.features
    for setting, key in keys.items():
        if key not in features:
            raise ValueError(
                f"{source}.{setting} {key!r} is not a feature of {builder.name!r}; its "
                f"features: {sorted(features.keys())}"
            )
