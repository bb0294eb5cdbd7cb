"""Makes the library's models, data sets, losses, optimizers and remat policies configurable.

The one place where gin meets `framework.models`, `framework.data`,
`framework.trainer.losses`, `framework.trainer.optim` and `framework.remat` (t5x keeps gin at the
edge the same way). `Trainer` and `Runtime` register themselves, and the trainer imports this
module: importing `framework.trainer` registers every name `configs/*.gin` use. The
trainer's default loss and optimizer are the registered functions below, so a binding such as
`optim.adamw.beta_2 = 0.98` takes effect whether or not `Trainer.optimizer_fn` is bound.
"""

from collections.abc import Sequence

import gin

from framework import remat
from framework.data import images, synthetic_images, text, tfds, tfds_text, tfrecord, token_records
from framework.models import language, vit
from framework.trainer import losses, optim

for _model in (vit.VisionTransformer, vit.vit_tiny, vit.vit_small, vit.vit_b16, vit.vit_l16):
    gin.external_configurable(_model, module="models")

gin.external_configurable(synthetic_images.shapes, module="data")
for _data in (images.image_folder, tfrecord.tfrecord, tfds.tfds):
    gin.external_configurable(_data, module="data")

for _model in (
    language.DecoderLM,
    language.BertEncoder,
    language.decoder_tiny,
    language.decoder_1b,
    language.bert_tiny,
    language.bert_base,
    language.bert_large,
):
    gin.external_configurable(_model, module="models")

for _data in (
    text.TextCorpus,
    tfds_text.TfdsText,
    token_records.TokenRecords,
    text.text_lm,
    text.text_mlm,
):
    gin.external_configurable(_data, module="data")
gin.constant("data.SAMPLE_CORPUS", text.SAMPLE_CORPUS)

cross_entropy = gin.external_configurable(losses.cross_entropy, module="losses")
adamw = gin.external_configurable(optim.adamw, module="optim")
sgd = gin.external_configurable(optim.sgd, module="optim")
adafactor = gin.external_configurable(optim.adafactor, module="optim")


@gin.configurable(module="remat")
def save_only_these_names(names: Sequence[str]) -> remat.policies.Policy:
    """`remat.policies.save_only_these_names` with its names as one gin-bindable list."""
    return remat.policies.save_only_these_names(*names)


@gin.configurable(module="remat")
def save_any_names_but_these(names: Sequence[str]) -> remat.policies.Policy:
    """`remat.policies.save_any_names_but_these` with its names as one gin-bindable list."""
    return remat.policies.save_any_names_but_these(*names)
