"""`set_grad_checkpointing` on models no one here wrote: keras-hub backbones, keras.applications.

Small configurations built in the test (random weights, nothing downloaded). Each case restores
every variable (seed generator states and BatchNorm statistics included) before each run,
compares gradients with no remat on the same inputs with dropout on, checks the variables the
step writes (BatchNorm statistics once, seeds advanced once), and counts the regions' runs: a
checkpoint that silently does nothing runs each region once, not twice.
"""

from __future__ import annotations

import logging

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from framework import memory, remat
from framework.core import tf_internals
from framework.remat import segments

MODES = ["eager", "graph", "xla"]
# BatchNorm over 2 images of 32 px amplifies float32 rounding; remat changes how the graph is
# fused and ordered, so MobileNetV3's gradients differ in the fifth digit (3e-5).
APPLICATIONS_TOL = 1e-4


def _tokens(batch: int = 2, length: int = 8, vocabulary: int = 50) -> dict:
    ids = tf.random.stateless_uniform((batch, length), [1, 2], 1, vocabulary, tf.int32)
    return {"token_ids": ids, "padding_mask": tf.ones((batch, length), tf.int32)}


def _hub(name: str, dropout: float = 0.2):
    keras.utils.set_random_seed(0)
    text = dict(vocabulary_size=50, num_layers=2, hidden_dim=16, intermediate_dim=32)
    if name == "vit":
        model = keras_hub.models.ViTBackbone(
            image_shape=(32, 32, 3), patch_size=8, num_layers=2, num_heads=2, hidden_dim=16,
            mlp_dim=32, dropout_rate=dropout, attention_dropout=dropout,
        )  # fmt: skip
        return model, tf.random.stateless_normal((2, 32, 32, 3), [3, 4])
    if name == "gemma":
        model = keras_hub.models.GemmaBackbone(
            num_query_heads=2, num_key_value_heads=1, head_dim=8, dropout=dropout, **text
        )
        return model, _tokens()
    if name == "bert":
        model = keras_hub.models.BertBackbone(
            num_heads=2, max_sequence_length=16, dropout=dropout, **text
        )
        return model, {**_tokens(), "segment_ids": tf.zeros((2, 8), tf.int32)}
    if name == "albert":  # one TransformerEncoder, called num_layers times
        model = keras_hub.models.AlbertBackbone(
            num_heads=2, embedding_dim=8, num_groups=1, max_sequence_length=16, dropout=dropout,
            **text,
        )  # fmt: skip
        return model, {**_tokens(), "segment_ids": tf.zeros((2, 8), tf.int32)}
    if name == "mixtral":  # its blocks add the router's load-balancing loss (add_loss)
        model = keras_hub.models.MixtralBackbone(
            vocabulary_size=50, num_layers=2, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, num_experts=4, top_k=2, dropout=dropout,
            router_aux_loss_coef=1.0,
        )  # fmt: skip
        return model, _tokens()
    model = keras_hub.models.GPT2Backbone(
        num_heads=2, max_sequence_length=16, dropout=dropout, **text
    )
    return model, _tokens()


def _application(name: str, size: int = 32):
    keras.utils.set_random_seed(0)
    build = {
        "resnet50": keras.applications.ResNet50,
        "convnext": keras.applications.ConvNeXtTiny,
        "efficientnet": keras.applications.EfficientNetB0,
        "mobilenetv3": keras.applications.MobileNetV3Small,
    }[name]
    model = build(weights=None, input_shape=(size, size, 3), classes=10)
    return model, tf.random.stateless_normal((2, size, size, 3), [5, 6])


def _output(y) -> tf.Tensor:
    if isinstance(y, dict):
        y = y["sequence_output"]
    return tf.cast(y, tf.float32)


def _compiled(step, mode: str):
    return step if mode == "eager" else tf.function(step, jit_compile=mode == "xla")


def _run(model, x, mode: str):
    """Gradients of a fixed random projection of the output plus the losses the model added (as
    `fit` adds them), and the variables after the step; every variable is put back as it was
    before."""
    start = [v.numpy() for v in model.variables]

    def step(x):
        with tf.GradientTape() as tape:
            y = _output(model(x, training=True))
            loss = tf.reduce_sum(y * tf.random.stateless_normal(tf.shape(y), [7, 8]))
            loss += sum(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        return [None if g is None else tf.convert_to_tensor(g) for g in grads]

    grads = [None if g is None else g.numpy() for g in _compiled(step, mode)(x)]
    after = [v.numpy() for v in model.non_trainable_variables]
    for v, value in zip(model.variables, start, strict=True):
        v.assign(value)
    return grads, after


def _relative_error(got: list, want: list) -> float:
    assert [g is None for g in got] == [w is None for w in want]
    pairs = [(g, w) for g, w in zip(got, want) if w is not None]
    diff = sum(np.sum((g.astype(np.float64) - w) ** 2) for g, w in pairs)
    return float(np.sqrt(diff / sum(np.sum(w.astype(np.float64) ** 2) for _, w in pairs)))


def _count_runs(model) -> list:
    """Counters of each checkpointed region's Python runs (forward pass and recomputation)."""
    regions = [layer.call for layer in remat.checkpointed_layers(model)]
    for graph in [model, *model._flatten_layers(include_self=False)]:  # nested: a backbone
        runner = tf_internals.is_functional(graph) and tf_internals.functional_runner(graph)
        if isinstance(runner, segments.SegmentedGraph):
            regions += [region for _, region in runner._plan if region is not None]
    counts = []
    for region in regions:
        counts.append([0])

        def counted(*args, _fn=region.fn, _count=counts[-1], **kwargs):
            _count[0] += 1
            return _fn(*args, **kwargs)

        region.fn = counted
    return counts


def _check(model, x, mode: str, tol: float = 1e-5, runs: int = 2, **remat_kwargs):
    """`runs`: how often each region's code runs at least (its calls, each recomputed)."""
    want, state_want = _run(model, x, mode)
    regions = remat.set_grad_checkpointing(model, **remat_kwargs)
    counts = _count_runs(model)
    got, state_got = _run(model, x, mode)
    assert regions and counts
    assert all(c[0] >= runs for c in counts), [c[0] for c in counts]
    assert _relative_error(got, want) < tol
    for after, expected in zip(state_got, state_want, strict=True):  # BatchNorm, seeds: once
        np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-6)
    return regions


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["vit", "bert", "gpt2", "gemma", "mixtral", "albert"])
def test_keras_hub_backbones_match_no_remat(name, mode):
    model, x = _hub(name)
    model(x)
    regions = _check(model, x, mode, runs=4 if name == "albert" else 2)
    assert all(isinstance(r, keras.layers.Layer) for r in regions)  # the transformer blocks
    assert len(regions) == (1 if name == "albert" else 2)  # ALBERT's: one layer, called twice


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "convnext", "efficientnet", "mobilenetv3"])
def test_keras_applications_get_segments_that_match_no_remat(name):
    model, x = _application(name)
    regions = _check(model, x, "graph", tol=APPLICATIONS_TOL)
    assert all(isinstance(r, segments.Segment) for r in regions)
    assert {"resnet50": 16, "convnext": 18, "efficientnet": 16, "mobilenetv3": 10}[name] == len(
        regions
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "mode", "policy"),
    [
        ("convnext", "eager", "nothing_saveable"),
        # Traced eagerly: its segments' residual adds are Keras operations, not layers.
        ("convnext", "eager", "dots_saveable"),
        ("mobilenetv3", "xla", "nothing_saveable"),
    ],
)
def test_keras_applications_in_eager_and_xla(name, mode, policy):
    model, x = _application(name)
    _check(model, x, mode, tol=APPLICATIONS_TOL, policy=policy)


@pytest.mark.slow
def test_fit_through_segments_and_hub_blocks_matches_no_remat():
    def fitted(build, with_remat: bool, jit_compile: bool):
        model, x = build()
        features = model.output["sequence_output"] if isinstance(model.output, dict) else None
        if features is not None:
            model = keras.Model(model.input, keras.layers.Dense(1)(features))
        if with_remat:
            assert len(remat.set_grad_checkpointing(model)) >= 2
        y = tf.ones(model(x).shape)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=1, epochs=1, shuffle=False, verbose=0)  # two steps
        return [v.numpy() for v in model.trainable_variables]

    # Segments under XLA and hub blocks in graph mode are checked above; fit adds Keras' own
    # train step, compiled by XLA for the transformer and by the graph runtime for MobileNet.
    cases = [(lambda: _application("mobilenetv3"), False), (lambda: _hub("bert"), True)]
    for build, jit_compile in cases:
        got, want = fitted(build, True, jit_compile), fitted(build, False, jit_compile)
        assert _relative_error(got, want) < APPLICATIONS_TOL


@pytest.mark.slow
def test_full_remat_lowers_xla_temp_memory_of_resnet50():
    model, _ = _application("resnet50", size=128)
    spec = tf.TensorSpec((4, 128, 128, 3))

    def plan():
        @tf.function(jit_compile=True)
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)

        return memory.compiled_bytes(step, spec).temp_bytes

    before = plan()
    remat.set_grad_checkpointing(model)
    assert plan() < 0.7 * before  # 0.57 at 160 px, batch 8 (docs/remat.md)


def test_segments_of_a_chain_every_and_saving(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(16)])
    found = segments.segments(model)
    assert [len(s.nodes) for s in found] == [4, 4, 4, 4]  # sqrt(16) layers each
    assert [len(s.nodes) for s in segments.segments(model, every=8)] == [8, 8]
    x = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    before = model.predict(x, verbose=0)
    assert len(remat.set_grad_checkpointing(model)) == 4
    np.testing.assert_allclose(model.predict(x, verbose=0), before, rtol=1e-6)
    model.save(tmp_path / "chain.keras")  # the remat setting is not saved: a plain model loads
    loaded = keras.saving.load_model(tmp_path / "chain.keras")
    assert segments.installed(loaded) == []
    np.testing.assert_allclose(loaded.predict(x, verbose=0), before, rtol=1e-6)
    resnet, _ = _application("resnet50")
    assert len(segments.segments(resnet, every=4)) == 4
    chosen = remat.set_grad_checkpointing(resnet, every=4)
    assert len(chosen) == 4 and segments.installed(resnet) == chosen
    assert remat.set_grad_checkpointing(resnet, enable=False) == []
    assert segments.installed(resnet) == []


@pytest.mark.parametrize("mode", MODES)
def test_fit_through_segments_with_activity_regularizers_matches_no_remat(mode):
    """Losses the segments' layers add are results of the regions: `fit` differentiates them."""

    def chain():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((8,))]
        for i in range(8):
            regularizer = keras.regularizers.L2(0.1) if i % 3 == 0 else None
            layers.append(keras.layers.Dense(8, "tanh", activity_regularizer=regularizer))
            layers.append(keras.layers.Dropout(0.3, seed=i))
        return keras.Sequential([*layers, keras.layers.Dense(1)])

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 1)).astype(np.float32)
    results = []
    for checkpointed in (False, True):
        model = chain()
        if checkpointed:
            assert len(remat.set_grad_checkpointing(model)) == 4
            counts = _count_runs(model)
        model.compile(
            keras.optimizers.SGD(0.1), "mse", run_eagerly=mode == "eager", jit_compile=mode == "xla"
        )
        history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        results.append((model.get_weights(), history.history["loss"]))
    assert all(c[0] >= 2 for c in counts), [c[0] for c in counts]
    (want, want_loss), (got, got_loss) = results
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_that_make_a_layer_in_their_call_match_no_remat(mode):
    """keras-hub's Flux blocks make an Activation layer at every call: the recomputation's has
    another name, and is the same computation."""

    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(8)
            self.drop = keras.layers.Dropout(0.3)

        def call(self, x, training=None):
            return self.drop(self.dense(keras.layers.Activation("silu")(x)), training=training)

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), Block(), Block()])
    x = tf.random.stateless_normal((2, 8), [1, 2])
    _check(model, x, mode)


# XLA's compile of this model is 35 s of the fast tier: that mode runs with the slow tests.
@pytest.mark.parametrize("mode", ["graph", pytest.param("xla", marks=pytest.mark.slow)])
def test_a_backbone_under_a_new_head_gets_the_segments(mode):
    """A functional backbone run as one layer of the model (keras-hub's image classifiers,
    fine-tuning keras.applications): its graph is cut, not the model's two nodes."""
    keras.utils.set_random_seed(0)
    backbone = keras.applications.MobileNetV3Small(
        weights=None, include_top=False, input_shape=(32, 32, 3)
    )
    x = tf.random.stateless_normal((2, 32, 32, 3), [5, 6])
    inputs = keras.Input((32, 32, 3))
    features = keras.layers.GlobalAveragePooling2D()(backbone(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dropout(0.2)(features)))
    regions = _check(model, x, mode, tol=APPLICATIONS_TOL)
    assert regions == segments.installed(backbone) and len(regions) >= 5


def test_repeated_containers_around_blocks_wired_in_the_graph_give_way_to_segments():
    """keras.applications' ConvNeXt builds its stem and downsampling layers as `Sequential`s and
    its blocks in the functional graph. With few blocks, the four `Sequential`s were taken for
    the repeated blocks: regions that kept more than no remat (1.83 times, at depths 1-1-2-1)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    h = inputs
    for stage, width in enumerate([8, 16, 32]):
        first = [keras.layers.Conv2D(width, 2, strides=2), keras.layers.LayerNormalization()]
        h = keras.Sequential(first if stage == 0 else first[::-1], name=f"down{stage}")(h)
        for _ in range(2):
            inner = keras.layers.Conv2D(width * 2, 1, activation="gelu")(h)
            h = keras.layers.Add()([h, keras.layers.Conv2D(width, 1)(inner)])
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(h))
    regions = _check(model, tf.random.stateless_normal((2, 16, 16, 3), [5, 6]), "graph")
    assert all(isinstance(r, segments.Segment) for r in regions) and len(regions) >= 4, regions


def test_other_callers_of_a_segmented_graph_get_keras_own_runner():
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(8)])
    assert len(remat.set_grad_checkpointing(model)) >= 2
    clone = keras.models.clone_model(model)  # its own layers, not the original's
    assert not any(a is b for a, b in zip(clone.layers, model.layers))
    nodes = [len(layer._inbound_nodes) for layer in model.layers]
    model(keras.Input((8,)))  # a symbolic call adds a node to the model, none to its layers
    assert [len(layer._inbound_nodes) for layer in model.layers] == nodes


def test_each_call_says_what_it_checkpointed(caplog):
    model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(8)])
    with caplog.at_level(logging.INFO):
        regions = remat.set_grad_checkpointing(model, policy="dots_saveable")
        assert remat.checkpointed_regions(model) == regions  # segments, not layers
        assert remat.checkpointed_layers(model) == []
        remat.set_grad_checkpointing(model, enable=False)
    assert remat.checkpointed_regions(model) == [] and remat.checkpointed_layers(model) == []
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("remat:")]
    assert lines == [
        f"remat: model {model.name!r} checkpointed in {len(regions)} regions "
        f"({len(regions)} segments of its layer graph), policy dots_saveable",
        f"remat: checkpointing removed from model {model.name!r}",
    ]


def test_selections_that_match_nothing_or_save_nothing_are_loud():
    model, x = _application("mobilenetv3")
    with pytest.raises(ValueError, match="No layer .* is an instance of .*LSTM.*Conv2D x"):
        remat.set_grad_checkpointing(model, layers=keras.layers.LSTM)
    with pytest.raises(ValueError, match="predicate matches no layer"):
        remat.set_grad_checkpointing(model, layers=lambda layer: False)
    # A misspelt name: the closest names and a summary, not every layer's name.
    with pytest.raises(ValueError) as misspelt:
        remat.set_grad_checkpointing(model, layers=["expanded_conv_projct"])
    message = str(misspelt.value)
    assert "(closest: expanded_conv_" in message and "_project" in message, message
    assert "layers: Conv2D x" in message
    assert len(message) < 600, message
    with pytest.warns(remat.RematSavesNothingWarning, match="single layers"):
        remat.set_grad_checkpointing(model, layers=keras.layers.Conv2D)
    with pytest.raises(ValueError, match="layers= or every="):
        remat.set_grad_checkpointing(model, layers=keras.layers.Conv2D, every=2)

    inputs = keras.Input((8,))  # one skip over the whole graph: nowhere to cut it
    h = keras.layers.Dense(8)(inputs)
    out = keras.layers.Add()([keras.layers.Dense(8)(keras.layers.Dense(8)(h)), h])
    skip = keras.Model(inputs, out)
    with pytest.warns(remat.RematSavesNothingWarning, match="no place where one tensor"):
        assert remat.set_grad_checkpointing(skip) == []
    with pytest.raises(ValueError, match="no place where one tensor"):
        remat.set_grad_checkpointing(skip, every=1)


def test_keras_hubs_single_layers_are_no_blocks():
    """BART has two PositionEmbedding layers (encoder and decoder): a repeated keras-hub class
    with weights, but a single layer, whose region would keep its input to recompute a slice of
    its table. The default takes the transformer layers only; naming it warns."""
    model = keras_hub.models.BartBackbone(
        vocabulary_size=50, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=16,
    )  # fmt: skip
    chosen = remat.set_grad_checkpointing(model)
    assert sorted(type(layer).__name__ for layer in chosen) == [
        "TransformerDecoder", "TransformerDecoder", "TransformerEncoder", "TransformerEncoder",
    ]  # fmt: skip
    with pytest.warns(remat.RematSavesNothingWarning, match="single layers"):
        remat.set_grad_checkpointing(model, layers=keras_hub.layers.PositionEmbedding)


@pytest.mark.parametrize("name", ["vit", pytest.param("mobilenetv3", marks=pytest.mark.slow)])
def test_summary_says_what_is_wrapped_and_what_it_saves(name):
    model, x = _hub(name) if name == "vit" else _application(name)
    lines: list[str] = []
    remat.set_grad_checkpointing(model, policy="nothing_saveable")
    report = remat.summary(model, x, print_fn=lines.append)
    regions = remat.checkpointed_regions(model)
    assert [r.name for r in report.regions] == [r.name for r in regions]
    assert {r.policy for r in report.regions} == {"nothing_saveable"}
    if name == "vit":  # keras-hub's blocks are layers; keras.applications' are graph segments
        assert {r.kind for r in report.regions} == {"ViTEncoderBlock"}
    else:
        assert all(r.kind.startswith("segment of ") for r in report.regions)
    assert report.kept_with_remat < 0.6 * report.kept_without_remat
    assert lines == [str(report)] and f"{len(regions)} checkpointed regions" in lines[0]
    # What it calls "without remat" is the model with checkpointing removed, to the byte.
    remat.set_grad_checkpointing(model, enable=False)
    plain = remat.summary(model, x, print_fn=None)
    assert plain.regions == () and plain.kept_with_remat == report.kept_without_remat
    assert str(plain).startswith(f"remat: model {model.name!r} has no checkpointed region")
