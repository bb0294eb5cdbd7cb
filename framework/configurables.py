"""Makes the library's models, data sets and remat policies configurable.

The one place where gin meets `framework.models`, `framework.data` and `framework.remat` (t5x
keeps gin at the edge the same way). The trainer's parts register themselves (`Trainer` with its
losses and optimizers in `trainer.settings`, `Runtime`), and the trainer imports this module:
importing `framework.trainer.trainer` registers every name `configs/*.gin` use.
"""

from collections.abc import Sequence

import gin

from framework import remat
from framework.data import text
from framework.data.images import pipeline, synthetic, tfds, tfrecord
from framework.data.text import tfds_text, token_records
from framework.models import language, vit

for _model in (vit.VisionTransformer, vit.vit_tiny, vit.vit_small, vit.vit_b16, vit.vit_l16):
    gin.external_configurable(_model, module="models")

gin.external_configurable(synthetic.shapes, module="data")
for _data in (pipeline.image_folder, tfrecord.tfrecord, tfds.tfds):
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


@gin.configurable(module="remat")
def save_only_these_names(names: Sequence[str]) -> remat.policies.Policy:
    """`remat.policies.save_only_these_names` with its names as one gin-bindable list."""
    return remat.policies.save_only_these_names(*names)


@gin.configurable(module="remat")
def save_any_names_but_these(names: Sequence[str]) -> remat.policies.Policy:
    """`remat.policies.save_any_names_but_these` with its names as one gin-bindable list."""
    return remat.policies.save_any_names_but_these(*names)
