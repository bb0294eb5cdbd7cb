"""The private TensorFlow and Keras APIs of `framework.core.tf_internals` on the installed release.

These run first on a new TensorFlow (`pytest -m tf_compat`): each wrapper is called once on real
TensorFlow objects, so a release that moves one of them fails here by name, and the version check
must name the supported releases.
"""

import importlib.metadata
import threading
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from packaging.requirements import Requirement

from framework.core import releases, tf_internals
from tests.subprocesses import run_python


@pytest.mark.tf_compat
def test_the_installed_tensorflow_is_supported_and_matches_setup_py():
    assert tf_internals.unsupported_tensorflow_message(tf.__version__) is None
    requirements = [Requirement(r) for r in importlib.metadata.requires("framework")]
    ranges = {r.name: r.specifier for r in requirements if r.name.startswith("tensorflow")}
    newest = tf_internals.SUPPORTED_TENSORFLOW[-1]
    after = f"{newest.split('.')[0]}.{int(newest.split('.')[1]) + 1}.0"
    for name in ("tensorflow", "tensorflow-text"):
        assert all(f"{v}.0" in ranges[name] for v in tf_internals.SUPPORTED_TENSORFLOW), ranges
        assert after not in ranges[name], ranges


def test_a_release_added_to_the_list_is_supported_by_the_framework_and_the_tpu_launcher(
    monkeypatch,
):
    """One list (`framework.core.releases`, no TensorFlow there) decides for both: the warning
    at import here, and the launcher's check of a TPU image and its choice of runtime."""
    from launch.tpu import topology

    runtime = topology.TpuRuntime.parse("tpu-vm-tf-2.22.0-pjrt")
    assert tf_internals.unsupported_tensorflow_message("2.22.0") and not runtime.supported()
    monkeypatch.setattr(releases, "SUPPORTED_TENSORFLOW", ("2.21", "2.22"))
    assert tf_internals.unsupported_tensorflow_message("2.22.0") is None and runtime.supported()
    assert topology.newest_runtime([runtime.name], "v4-8") == runtime.name


@pytest.mark.tf_compat
@pytest.mark.parametrize("version", ["2.19.1", "2.22.0-dev20260101", "3.0.0", "nightly"])
def test_an_unsupported_tensorflow_warns_naming_the_supported_ones(version):
    with pytest.warns(tf_internals.UnsupportedTensorFlowWarning) as caught:
        tf_internals.warn_if_unsupported(version)
    message = str(caught[0].message)
    assert f"TensorFlow {version} is installed" in message
    assert "supports TensorFlow 2.20 and 2.21 only" in message
    assert 'pip install "tensorflow==2.21.*" "tensorflow-text==2.21.*"' in message


@pytest.mark.tf_compat
@pytest.mark.parametrize("version", ["2.20.0", "2.21.1", "2.21.0rc1"])
def test_a_supported_tensorflow_does_not_warn(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf_internals.warn_if_unsupported(version)


@pytest.mark.tf_compat
def test_graph_wrappers_on_real_ops():
    seen = []

    def record(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        seen.append(op_type)

    def body(x):
        tf_internals.add_op_callback(record)
        try:
            a = tf.identity(x, name="a")
            b = tf.identity(x, name="b")
        finally:
            tf_internals.remove_op_callback(record)
        graph = tf.compat.v1.get_default_graph()
        assert not tf_internals.executing_eagerly()
        assert tf_internals.creation_index(a.op) < tf_internals.creation_index(b.op)
        tf_internals.add_control_input(b.op, a.op)
        tf_internals.update_input(b.op, 0, a * 3.0)
        tf_internals.set_string_attr(b.op, "_framework_test", "tag")
        assert b.op.get_attr("_framework_test") == b"tag"
        assert a.op in b.op.control_inputs
        branch = tf.cond(x[0] > 0, lambda: inner(graph, x), lambda: x)
        return b + 0 * branch

    def inner(outer, x):
        graph = tf.compat.v1.get_default_graph()
        assert tf_internals.is_control_flow_graph(graph) and not tf_internals.is_control_flow_graph(
            outer
        )
        assert tf_internals.outer_graph(graph) is outer
        return x

    x = tf.constant([2.0])
    assert tf_internals.executing_eagerly() and tf_internals.runtime_started()
    assert float(tf_internals.trace_function(body, x)(x)[0]) == 6.0
    assert seen == ["Identity", "Identity"]
    assert tf_internals.outer_graph(tf.Graph()) is None


@pytest.mark.tf_compat
def test_tape_autograph_captures_and_jit_compile():
    v = tf.Variable(1.0)
    assert not tf_internals.tape_is_active()
    with tf.GradientTape():
        assert tf_internals.tape_is_active()
        with tf_internals.stop_recording():
            assert not tf_internals.tape_is_active()

    def traced(x):
        y = x + v
        graph = tf.compat.v1.get_default_graph()
        [inside] = [internal for external, internal in graph.captures if external is v.handle]
        assert tf_internals.outermost(inside) is v.handle
        assert tf_internals.outermost(y) is y
        return y

    tf_internals.trace_function(traced, tf.constant(1.0))
    assert tf_internals.is_jit_compiled(tf.function(lambda: 0, jit_compile=True))
    assert not tf_internals.is_jit_compiled(tf.function(lambda: 0))
    assert tf_internals.autograph_like_caller(lambda: 7)() == 7

    @tf_internals.called_as_is_by_autograph
    class Caller:
        def __call__(self, x):
            statuses.append(tf.__internal__.autograph.control_status_ctx().status.name)
            return x

    statuses = []
    tf.function(lambda x: Caller()(x))(tf.constant(1.0))
    assert statuses == ["ENABLED"]


@pytest.mark.tf_compat
def test_a_watched_non_trainable_variable_reaches_custom_gradient():
    frozen, free = tf.Variable(2.0, trainable=False), tf.Variable(3.0, trainable=False)

    @tf.custom_gradient
    def double(x):
        for v in tf_internals.untrainable_variables_watched([frozen, free]):
            tf_internals.mark_read_for_custom_gradient(v)

        def grad_fn(dy, variables=None):
            return 2 * dy, [dy * (i + 10) for i, _ in enumerate(variables or [])]

        return 2 * x, grad_fn

    with tf.GradientTape() as tape:
        tape.watch(frozen)
        y = double(tf.constant(1.0))
    assert tape.gradient(y, [frozen, free]) == [10.0, None]


@pytest.mark.tf_compat
def test_optimization_barrier_passes_values_through_in_eager_graph_and_xla():
    x, bits = tf.constant([1.5, -2.0]), tf.constant([7, 8])
    barrier = tf_internals.optimization_barrier
    for run in (barrier, tf.function(barrier), tf.function(barrier, jit_compile=True)):
        a, b = run([x, bits])
        assert a.numpy().tolist() == [1.5, -2.0] and b.numpy().tolist() == [7, 8]
    program = tf.function(barrier, jit_compile=True).experimental_get_compiler_ir([x, bits])()
    assert "opt-barrier" in program
    assert barrier([]) == []


@pytest.mark.tf_compat
def test_xla_protos_read_the_compiled_program_and_its_buffer_assignment():
    fn = tf.function(lambda x: tf.matmul(x, x), jit_compile=True)
    x = tf.ones([4, 4])
    ir = fn.experimental_get_compiler_ir(x)(stage="optimized_hlo_proto_serialized")
    proto = tf_internals.hlo_pb2.HloProto.FromString(ir)
    assert proto.buffer_assignment.buffer_allocations
    shapes = [i.shape for c in proto.hlo_module.computations for i in c.instructions]
    assert tf_internals.xla_data_pb2.F32 in {shape.element_type for shape in shapes}


@pytest.mark.tf_compat
def test_flatten_layers_lists_children_and_descendants():
    inner = keras.Sequential([keras.layers.Dense(2), keras.layers.Dense(3)])
    outer = keras.Sequential([inner, keras.layers.Dense(4)])
    assert tf_internals.flatten_layers(outer, recursive=False) == outer.layers
    assert len(tf_internals.flatten_layers(outer, recursive=True)) == 4


@pytest.mark.tf_compat
def test_an_optimizer_without_the_keras_all_reduce_hook_is_refused():
    with pytest.raises(TypeError, match="no base class defines _all_reduce_sum_gradients"):

        class Unhooked(tf_internals.GradientsAlreadyReduced):
            pass


# Keras sums gradients over replicas before applying them (plain SGD moves by 2 * lr * 1 on two
# replicas); GradientsAlreadyReduced must take them as given (lr * 1).
_MIRRORED_SGD_STEP = """
    import json
    import keras, tensorflow as tf
    from framework.runtime import distribute
    from framework.core import releases, tf_internals

    strategy = distribute.create_strategy("mirrored", cpu_devices=2)

    class Given(tf_internals.GradientsAlreadyReduced, keras.optimizers.SGD):
        pass

    moved = {}
    for optimizer_class in (keras.optimizers.SGD, Given):
        with strategy.scope():
            v = tf.Variable(0.0)
            optimizer = optimizer_class(learning_rate=0.5)
            optimizer.build([v])

        @tf.function
        def step():
            strategy.run(lambda: optimizer.apply_gradients([(tf.constant(1.0), v)]))

        step()
        moved[optimizer_class.__name__] = -float(v.numpy())
    moved["replicas"] = strategy.num_replicas_in_sync
    with strategy.scope(), tf_internals.trainable_variables_on("/cpu:0"):
        weight, state = tf.Variable(1.0), tf.Variable(1, trainable=False)
    moved["made"] = [type(weight).__name__, weight.device[-5:], type(state).__name__]
    print(json.dumps(moved))
"""


@pytest.mark.tf_compat
def test_gradients_already_reduced_are_applied_as_given_under_mirrored():
    moved = run_python(_MIRRORED_SGD_STEP)
    # And under the strategy, a trainable variable made on the host is one plain variable there,
    # the others still one per replica.
    made = ["ResourceVariable", "CPU:0", "MirroredVariable"]
    assert moved == {"SGD": 1.0, "Given": 0.5, "replicas": 2, "made": made}


@pytest.mark.tf_compat
def test_keras_call_state_layer_path_masks_and_functional_graph():
    seen = {}

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen["state"] = tf_internals.keras_call_state()
            seen["path"] = tf_internals.keras_layer_path()
            return x

    class Outer(keras.layers.Layer):
        def __init__(self):
            super().__init__(name="outer")
            self.probe = Probe(name="probe")

        def call(self, x):
            return self.probe(x)

    # In a thread of its own: Keras keeps its layers' name scopes per thread, and a layer call
    # that raised while a tf.function traced it leaves its scope open (Keras 3.15), as an
    # earlier test in this process may have done.
    thread = threading.Thread(target=lambda: Outer()(tf.ones([1, 2]), training=True))
    thread.start()
    thread.join()
    assert seen["state"].context == (("training", True),)
    assert seen["path"] == ("outer", "probe")
    assert tf_internals.keras_call_state().context is None  # outside any layer call
    with tf_internals.keras_call_state_entered(seen["state"]):
        Probe()(tf.ones([1, 2]))
        assert tf_internals.keras_call_state().context == (("training", True),)
    assert tf_internals.keras_call_state().context is None

    x, mask = tf.ones([1, 2]), tf.constant([[True, False]])
    tf_internals.set_keras_mask(x, mask)
    assert tf_internals.keras_mask(x) is mask

    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(2)(inputs)))
    graph = tf_internals.functional_graph(model)
    assert [n.operation.name for n in graph.nodes] == [layer.name for layer in model.layers[1:]]
    values = {id(graph.inputs[0]): tf.ones([1, 2])}
    for node in graph.nodes:
        tf_internals.run_node(node, values, (("training", True),))
    np.testing.assert_allclose(values[id(graph.outputs[0])], model(tf.ones([1, 2])), rtol=1e-6)
    calls = []
    tf_internals.set_functional_runner(model, lambda *a, **k: calls.append(1) or tf.zeros([1, 3]))
    model(tf.ones([1, 2]))
    assert calls and tf_internals.functional_runner(model) is not None
    tf_internals.set_functional_runner(model, None)
    assert tf_internals.functional_runner(model) is None


@pytest.mark.tf_compat
def test_keras_reads_redirected_in_xla_with_gradients_and_seeds_advancing():
    """Redirected reads compute with the given tensor and differentiate to it; other variables
    (a dropout's seed state) read and advance as usual."""
    dense = keras.layers.Dense(2, use_bias=False)
    dense.build((None, 3))
    dropout = keras.layers.Dropout(0.5, seed=1)
    seed = dropout.seed_generator.state
    before = seed.numpy().copy()
    stand_in = tf.ones((3, 2))

    @tf.function(jit_compile=True)
    def step(x, kernel):
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            with tf_internals.keras_reads_redirected(
                lambda v: kernel if v is dense.kernel else None
            ):
                y = tf.reduce_sum(dropout(dense(x), training=True))
        return y, tape.gradient(y, kernel)

    x = tf.ones((4, 3))
    _, grad = step(x, stand_in)
    assert grad.shape == (3, 2) and float(tf.reduce_sum(tf.abs(grad))) > 0
    assert not np.array_equal(seed.numpy(), before)  # the seed advanced through the redirect
    with tf_internals.keras_reads_redirected(lambda v: stand_in if v is dense.kernel else None):
        np.testing.assert_array_equal(dense(x), 3.0)


@pytest.mark.tf_compat
def test_xla_collectives_lower_into_the_program_for_a_slice_of_replicas():
    @tf.function(jit_compile=True)
    def program(x):
        summed = tf_internals.xla_all_reduce(x, 4)
        return tf_internals.xla_reduce_scatter(summed, 4), tf_internals.xla_replica_id()

    hlo = program.experimental_get_compiler_ir(tf.zeros([8]))(stage="hlo")
    assert "all-reduce(" in hlo and "reduce-scatter(" in hlo and "replica-id(" in hlo
    assert "replica_groups={{0,1,2,3}}" in hlo
