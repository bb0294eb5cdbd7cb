"""Labelled images: the pipeline every image source shares (`pipeline`) and its sources - folders
of JPEG/PNG files (`pipeline.image_folder`), TFRecord files (`tfrecord`), TensorFlow Datasets
(`tfds`) and generated shapes (`synthetic`) - with decoding, cropping (`image_ops`) and
RandAugment, mixup and cutmix (`augment`)."""
