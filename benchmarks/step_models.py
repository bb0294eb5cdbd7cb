"""The models and the train step the remat benchmarks measure, in one place: a stack of
transformer blocks, ViT-B/16 and a decoder LM (`model_spec`), each rematerialization setting
applied to them (`build_model`), the XLA-compiled SGD step (`train_step`), the gradients'
error against no remat (`gradient_error`) and step times taken in turns (`median_step_times`).
`remat_policies.py`, `profile_step.py`, `tpu_xla_remat.py` and `tpu_compile_options.py` measure
the same steps with it."""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from framework import models, remat
from framework.core import tf_internals
from framework.models.language import DecoderLM

FULL_POLICIES = ("nothing_saveable", "random_masks_saveable")
SELECTIVE_POLICIES = (
    "dots_saveable",
    "dots_saveable+random_masks_saveable",
    "dots_with_no_batch_dims_saveable",
)
POLICIES = FULL_POLICIES + SELECTIVE_POLICIES
SETTINGS = ("none", *POLICIES, "recompute_grad", "rematscope_full", "rematscope_activations")
SETTING_LABELS = {
    "none": "no remat",
    "recompute_grad": "`tf.recompute_grad` per block",
    "rematscope_full": '`keras.RematScope("full")`',
    "rematscope_activations": '`keras.RematScope("activations")`',
    **{p: f"`{p}`" for p in POLICIES},
}
MODELS = ("stack", "vit_b16", "decoder_lm")
# Issue 3, "Measured": targets on ViT-B/16 at batch 8 as (memory ratio, time ratio) upper bounds.


class BlockStack(keras.Model):
    """`depth` TransformerBlocks in a row, built eagerly.

    Subclassed, like the ViT, rather than `keras.Sequential`: building a Sequential or functional
    model runs its layers symbolically, which `RematScope("full")` already breaks.
    """

    def __init__(self, depth: int, num_heads: int, mlp_dim: int, shape: tuple[int, int], **kw):
        super().__init__(**kw)
        self.blocks = [
            models.TransformerBlock(num_heads, mlp_dim, dropout=0.1, name=f"block_{i}")
            for i in range(depth)
        ]
        for block in self.blocks:
            block.build((None, *shape))
        self.built = True

    def call(self, x: tf.Tensor, training: bool | None = None) -> tf.Tensor:
        for block in self.blocks:
            x = block(x, training=training)
        return x


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: how to build it, its batch and its loss."""

    description: str
    build: Callable[[], Any]
    batch: Callable[[], tuple[Any, Any]]
    loss: Callable[[Any, Any], Any]


def model_spec(name: str, quick: bool) -> ModelSpec:
    """The benchmark's two models, full size or `quick` (tiny, for the smoke test)."""
    if name == "stack":
        depth, batch, seq, width, heads, mlp = (
            (2, 2, 16, 32, 2, 64) if quick else (12, 8, 197, 384, 6, 1536)
        )

        return ModelSpec(
            description=(
                f"{depth} x TransformerBlock, batch {batch}, sequence {seq}, width {width}, "
                f"{heads} heads, MLP {mlp}, dropout 0.1; loss: mean squared error"
            ),
            build=lambda: BlockStack(depth, heads, mlp, (seq, width), name="stack"),
            batch=lambda: (
                tf.random.stateless_normal((batch, seq, width), seed=(1, 2)),
                tf.random.stateless_normal((batch, seq, width), seed=(3, 4)),
            ),
            loss=lambda out, y: tf.reduce_mean(tf.square(out - y)),
        )
    if name == "vit_b16":
        batch, size, classes = (2, 32, 10) if quick else (8, 224, 1000)
        small = {"dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64, "patch_size": 8}
        overrides = {"image_size": size, "num_classes": classes, "dropout": 0.1}
        if quick:
            overrides |= small
        return ModelSpec(
            description=(
                f"ViT-B/16{' (quick: width 32, 2 blocks)' if quick else ''}, batch {batch}, "
                f"{size} px, {classes} classes, dropout 0.1; loss: softmax cross-entropy"
            ),
            build=lambda: models.vit_b16(**overrides),
            batch=lambda: (
                tf.random.stateless_normal((batch, size, size, 3), seed=(1, 2)),
                tf.random.stateless_uniform((batch,), seed=(3, 4), maxval=classes, dtype=tf.int32),
            ),
            loss=lambda logits, y: tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            ),
        )
    if name == "decoder_lm":
        batch, length = (2, 16) if quick else (4, 512)
        config = (
            {"vocab_size": 256, "dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}
            if quick
            else {"vocab_size": 32_000, "dim": 768, "depth": 12, "num_heads": 12, "mlp_dim": 3072}
        )

        def text_batch() -> tuple[dict, tf.Tensor]:
            tokens = tf.random.stateless_uniform(
                (batch, length + 1), seed=(1, 2), maxval=config["vocab_size"], dtype=tf.int32
            )
            positions = tf.broadcast_to(tf.range(length), (batch, length))
            inputs = {"tokens": tokens[:, :-1], "positions": positions}
            return inputs | {"segment_ids": tf.ones((batch, length), tf.int32)}, tokens[:, 1:]

        return ModelSpec(
            description=(
                f"decoder LM, width {config['dim']}, {config['depth']} blocks, "
                f"{config['vocab_size']} tokens, batch {batch} x {length}, dropout 0.1; "
                "loss: next-token softmax cross-entropy"
            ),
            build=lambda: DecoderLM(max_length=length, dropout=0.1, **config),
            batch=text_batch,
            loss=lambda logits, y: tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            ),
        )
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def _recompute_grad_blocks(model: Any) -> None:
    """Runs each TransformerBlock through `tf.recompute_grad`, the way a TF user wraps it.

    `tf.recompute_grad` rejects keyword arguments inside `tf.function`, so the block's other
    arguments (mask, `training`) are closed over and only the tensor goes through it.
    """
    for block in tf_internals.flatten_layers(model, recursive=True):
        if isinstance(block, models.TransformerBlock):

            def call(x, *args, original=block.call, **kwargs):
                return tf.recompute_grad(lambda h: original(h, *args, **kwargs))(x)

            object.__setattr__(block, "call", call)


def is_budget(setting: str) -> bool:
    """A memory-budget policy, `budget:F` (any fraction F from 0 to 1)."""
    return setting.startswith(remat.policies.BUDGET_PREFIX)


NAMES_PREFIX = "names:"


def is_names(setting: str) -> bool:
    """`names:a/b/...`: `save_only_these_names` for the `checkpoint_name` tags given (the
    framework's transformer blocks tag qkv_proj, attn_out, mlp_in and mlp_out)."""
    return setting.startswith(NAMES_PREFIX)


def policy_of(setting: str) -> remat.policies.Policy | str:
    """What `set_grad_checkpointing` gets for a policy setting (a name, `budget:F`, `names:...`)."""
    if is_names(setting):
        names = setting.removeprefix(NAMES_PREFIX).split("/")
        return remat.policies.save_only_these_names(*names)
    return setting


def label(setting: str) -> str:
    return SETTING_LABELS.get(setting) or f"`{setting}`"


def build_model(spec: ModelSpec, setting: str) -> Any:
    """Builds the model with `setting` applied; the same seed gives the same weights for all."""
    keras.utils.set_random_seed(0)
    if setting.startswith("rematscope_"):
        # RematScope only affects layers constructed inside it.
        with keras.RematScope(mode=setting.removeprefix("rematscope_")):
            return spec.build()
    model = spec.build()
    if setting in POLICIES or is_budget(setting) or is_names(setting):
        remat.set_grad_checkpointing(model, policy=policy_of(setting))
    elif setting == "recompute_grad":
        _recompute_grad_blocks(model)
    elif setting != "none":
        raise ValueError(f"unknown setting {setting!r}; choose from {SETTINGS}")
    return model


def one_line(error: BaseException) -> str:
    """The innermost reason of an error, without the wrappers Keras and tf.function add."""
    noise = ("Exception encountered", "Arguments received", "in user code", "File ", "•")
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(error).splitlines()]
    reasons = [line for line in lines if line and not line.startswith(noise)]
    return f"{type(error).__name__}: {reasons[-1] if reasons else ''}"[:160].replace("|", "/")


def gradient_error(spec: ModelSpec, model: Any, x: Any, y: Any) -> tuple[float, str]:
    """Largest relative error over the variables of `model`'s gradients against no remat.

    The reference is the same model built without remat, given `model`'s variables (the
    dropout seed generators' states included), so both draw the same dropout masks on the
    same batch. Compiled with XLA like the train step; if that crashes, eagerly.
    """
    reference = build_model(spec, "none")
    state = [v.numpy() for v in model.variables]

    def grads(m: Any) -> list:
        with tf.GradientTape() as tape:
            loss = spec.loss(m(x, training=True), y)
        return tape.gradient(loss, m.trainable_variables)

    for mode in ("xla", "eager"):
        for m in (model, reference):
            for variable, value in zip(m.variables, state, strict=True):
                variable.assign(value)
        run = tf.function(grads, jit_compile=True) if mode == "xla" else grads
        try:
            got = run(model)
        except Exception:
            if mode == "eager":
                raise
            continue
        want = run(reference)
        # Dense: an embedding's gradient is IndexedSlices, which do not subtract.
        got, want = ([tf.convert_to_tensor(g) for g in grads] for grads in (got, want))
        errors = [
            float(tf.norm(g - w) / (tf.norm(w) + 1e-30)) for g, w in zip(got, want, strict=True)
        ]
        return max(errors), mode
    raise AssertionError("unreachable")


def train_step(spec: ModelSpec, model: Any) -> Callable:
    """The benchmarked step for `model`: forward, backward and an SGD update, compiled by XLA."""
    optimizer = keras.optimizers.SGD(learning_rate=1e-4)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = spec.loss(model(x, training=True), y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


def median_step_times(steps_to_time: list[Callable], x: Any, y: Any, repeats: int) -> list[float]:
    """Median seconds per step of each function, timed in turns (one step each, `repeats` times)."""
    for step in steps_to_time:
        step(x, y).numpy()
    times: list[list[float]] = [[] for _ in steps_to_time]
    for _ in range(repeats):
        for step, spent in zip(steps_to_time, times, strict=True):
            start = time.perf_counter()
            step(x, y).numpy()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]
