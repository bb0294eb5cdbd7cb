"""Rematerialization (gradient checkpointing) for TensorFlow 2 and Keras 3.

One line on a model that already exists, JAX-style policies, exact gradients with dropout, and
recomputation that XLA keeps. See docs/remat.md.

    from framework import remat
    remat.set_grad_checkpointing(model, policy="dots_saveable")
    remat.set_grad_checkpointing(model, policy="dots_saveable+random_masks_saveable")
    block = remat.checkpoint(block_fn, policy="nothing_saveable")
    h = remat.checkpoint_name(h, "attn_out")
    remat.print_saved_residuals(loss_fn, x)
    remat.summary(model, batch)  # what is wrapped, and the activations it saves
"""

from framework.core.errors import (
    RecomputationMismatchError,
    RematError,
    UnreplayableRandomOpError,
)
from framework.remat import policies, segments
from framework.remat.checkpoint import checkpoint, is_checkpointed
from framework.remat.eager_rerun import TensorStoredAsideWarning
from framework.remat.keras_model import (
    RematSavesNothingWarning,
    checkpointed_layers,
    checkpointed_regions,
    set_grad_checkpointing,
)
from framework.remat.names import checkpoint_name, without_checkpoint_names
from framework.remat.op_callbacks import tied_to_pass
from framework.remat.policies import OpInfo, UnmatchedNameWarning, get_policy, policy_names
from framework.remat.residuals import Residual, print_saved_residuals, saved_residuals
from framework.remat.scan import scan
from framework.remat.summary import RematSummary, summary

__all__ = [
    "OpInfo",
    "RecomputationMismatchError",
    "RematError",
    "RematSummary",
    "RematSavesNothingWarning",
    "Residual",
    "TensorStoredAsideWarning",
    "UnmatchedNameWarning",
    "UnreplayableRandomOpError",
    "checkpoint",
    "checkpoint_name",
    "checkpointed_layers",
    "checkpointed_regions",
    "get_policy",
    "is_checkpointed",
    "policies",
    "policy_names",
    "print_saved_residuals",
    "saved_residuals",
    "scan",
    "segments",
    "summary",
    "set_grad_checkpointing",
    "tied_to_pass",
    "without_checkpoint_names",
]
