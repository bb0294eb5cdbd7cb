"""Makes the library's models and data sets configurable from gin, without gin in the library.

The one place where gin meets `framework.models` and `framework.data` (t5x keeps gin at the edge the
same way). Importing this module registers the names that `configs/*.gin` use.
"""

import gin

from framework.data import synthetic_images
from framework.models import vit

for _model in (vit.VisionTransformer, vit.vit_tiny, vit.vit_small, vit.vit_b16, vit.vit_l16):
    gin.external_configurable(_model, module="models")

gin.external_configurable(synthetic_images.shapes, module="data")
