"""Published ViT weights into a `VisionTransformer`, from a file the user passes in.

Modules: `files` reads `.npz` and `.safetensors`, `layouts` names what the original ViT's,
big_vision's and timm's files hold, `positions` resizes position embeddings, `vit` checks and
assigns. GELU differs: Flax's `nn.gelu` is the tanh approximation, so the original ViT and
big_vision weights match a model built with `approximate_gelu=True`; timm's use the exact form
(the default). The importer says so when the model computes the other one.
"""

from framework.models.weights.files import (
    WeightsError,
    is_weights_file,
    read_arrays,
    read_safetensors,
)
from framework.models.weights.positions import resize_positions
from framework.models.weights.vit import Imported, load_weights

__all__ = [
    "Imported",
    "WeightsError",
    "is_weights_file",
    "load_weights",
    "read_arrays",
    "read_safetensors",
    "resize_positions",
]
