"""`python -m framework.export`: a run's model as a SavedModel that plain TensorFlow serves.

Three tiny runs are made in this process the way the binary makes them (gin, then the
operative config written to config.gin): a ViT trained two steps, the same ViT trained with a
remat policy in mixed_bfloat16, and a decoder LM saved by its trainer at step 0. Their exports
are loaded in one fresh process that cannot import the framework, and must give the trainer's
outputs for the same eval batch.
"""

import dataclasses
import hashlib
import json
import pathlib
import re
import sys

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from framework import cli, export, train, trained_model
from framework.core.errors import UserError
from framework.models import language
from framework.trainer import trainer
from tests import tiny
from tests.subprocesses import run_json

TINY_LM = dict(vocab_size=32, max_length=8, dim=16, depth=2, num_heads=2, mlp_dim=32)

# The loader of the exports: any import of the framework fails, so whatever the SavedModels
# need, plain TensorFlow has it.
SERVE = """
import importlib.abc, json, sys

class NoFramework(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "framework" or name.startswith("framework."):
            raise ImportError(f"{name}: an export must not need the framework")

sys.meta_path.insert(0, NoFramework())
try:
    import framework
    blocked = False
except ImportError:
    blocked = True
import numpy as np
import tensorflow as tf

results = {"blocked": blocked}
for case in json.loads(sys.argv[1]):
    loaded = tf.saved_model.load(case["export_dir"])
    served = {}
    for signature, inputs in case["inputs"].items():
        function = loaded.signatures[signature]
        feed = {name: tf.constant(np.load(path)) for name, path in inputs.items()}
        outputs = function(**feed)
        for name, value in outputs.items():
            np.save(f"{case['out']}-{signature}-{name}.npy", value.numpy())
        graph = function.graph.as_graph_def()
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        served[signature] = {
            "dtypes": {name: value.dtype.name for name, value in outputs.items()},
            "ops": sorted(node.op for node in nodes),
            "text": str(graph),
        }
    results[case["name"]] = served
print(json.dumps(results))
"""


@dataclasses.dataclass
class Run:
    """A run, its export, an eval batch and what the trainer's model gives for it."""

    model_dir: str
    export_dir: str
    inputs: dict[str, dict[str, np.ndarray]]  # signature -> input name -> value
    expected: dict[str, np.ndarray]  # signature -> logits of a float32 model of the run's weights
    trainer_logits: np.ndarray  # what the trainer's own model gives
    record: dict = dataclasses.field(default_factory=dict)


def train_run(model_dir, gin_file: str, bindings: list[str], batch: int, steps: bool = True):
    """Trains as `python -m framework.train` does (the config parsed, the Trainer built, the
    operative config recorded in model_dir, then `train`; without `steps`, the trainer only
    saves its step 0); returns the Trainer and the inputs of its first eval batch of `batch`
    examples."""
    gin.clear_config()
    try:
        cli.parse_gin([gin_file], bindings, [str(cli.CONFIGS_DIR)])
        run = trainer.Trainer(str(model_dir))
        train.write_run_record(str(model_dir), gin.operative_config_str(), "test")
        if steps:
            run.train()
        else:
            run.save()
        return run, next(iter(run.settings.dataset_fn("eval", global_batch_size=batch)))[0]
    finally:
        gin.clear_config()


def vit_bindings(*extra: str) -> list[str]:
    shorthand = [flag.removeprefix("--gin.").replace("=", " = ", 1) for flag in tiny.GIN_FLAGS]
    return [*shorthand[1:], "Trainer.train_steps = 2", "Trainer.steps_per_loop = 2", *extra]


def vit_run(tmp, name: str, *extra: str) -> Run:
    run, images = train_run(tmp / name, "quickstart.gin", vit_bindings(*extra), batch=16)
    # The weights the trainer holds, in a float32 model of the same architecture: what an
    # export must compute whatever precision the run trained in.
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        float32 = tiny.model_fn()
    finally:
        keras.config.set_dtype_policy(policy)
    float32.set_weights(run.model.get_weights())
    return Run(
        str(tmp / name),
        str(tmp / f"{name}_export"),
        {"serving_default": {"images": images.numpy()}},
        {"serving_default": float32(images, training=False).numpy()},
        run.model(images, training=False).numpy(),
    )


def lm_run(tmp) -> Run:
    corpus = tmp / "corpus.txt"
    corpus.write_text(
        "\n".join(f"the quick brown fox jumps over the lazy dog {i % 7}" for i in range(40))
    )
    model = dict(vocab_size=96, max_length=16, dim=32, depth=2, num_heads=4, mlp_dim=48)
    data = dict(
        files=[str(corpus)],
        vocab_path=str(tmp / "lm" / "vocab.txt"),
        vocab_size=96,
        sequence_length=16,
        document_per="line",
        eval_fraction=0.3,
        log_stats=False,
    )
    bindings = [
        *(f"models.decoder_tiny.{name} = {value!r}" for name, value in model.items()),
        *(f"data.TextCorpus.{name} = {value!r}" for name, value in data.items()),
        "Trainer.global_batch_size = 4",
        "Trainer.count_flops = False",
    ]
    # Saved by its trainer at step 0: the ViT runs pay for the compiled training steps.
    run, rows = train_run(tmp / "lm", "lm_quickstart.gin", bindings, batch=4, steps=False)
    tokens = rows["tokens"]
    documents = {
        "tokens": tokens,
        "segment_ids": tf.ones_like(tokens),
        "positions": tf.broadcast_to(tf.range(tokens.shape[1]), tokens.shape),
    }
    return Run(
        str(tmp / "lm"),
        str(tmp / "lm_export"),
        {
            "serving_default": {"tokens": tokens.numpy()},
            "packed": {name: value.numpy() for name, value in rows.items()},
        },
        {
            "serving_default": run.model(documents, training=False).numpy(),
            "packed": run.model(rows, training=False).numpy(),
        },
        run.model(rows, training=False).numpy(),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("export")
    try:
        made = {
            "vit": vit_run(tmp, "vit"),
            "lm": lm_run(tmp),
            "remat_bf16": vit_run(  # last: its Keras dtype policy stays for the exports
                tmp,
                "remat_bf16",
                "Trainer.remat_policy = 'nothing_saveable'",
                "Runtime.precision = 'bfloat16'",
            ),
        }
        # The trainer left mixed_bfloat16 as Keras' policy: the exports must be float32 anyway.
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
        (tmp / "vit_export").mkdir()  # an empty export_dir is taken
        for run in made.values():
            run.record = export.export_run(run.model_dir, run.export_dir)
    finally:
        keras.config.set_dtype_policy("float32")
    return made


@pytest.mark.slow
def test_exports_serve_the_trainers_outputs_in_a_process_without_the_framework(runs, tmp_path):
    cases = []
    for name, run in runs.items():
        inputs = {}
        for signature, values in run.inputs.items():
            inputs[signature] = {}
            for input_name, value in values.items():
                path = tmp_path / f"{name}-{signature}-{input_name}.npy"
                np.save(path, value)
                inputs[signature][input_name] = str(path)
        cases.append(
            dict(name=name, export_dir=run.export_dir, inputs=inputs, out=str(tmp_path / name))
        )
    served = run_json(["-c", SERVE, json.dumps(cases)])
    assert served["blocked"], "the loader could import the framework"

    def logits(name: str, signature: str = "serving_default") -> np.ndarray:
        return np.load(tmp_path / f"{name}-{signature}-logits.npy")

    for name, run in runs.items():
        for signature, expected in run.expected.items():
            np.testing.assert_allclose(
                logits(name, signature), expected, rtol=1e-5, atol=1e-5, err_msg=name
            )
            assert set(served[name][signature]["dtypes"].values()) == {"float32"}
    # The trainer's own float32 models give the same logits.
    np.testing.assert_allclose(logits("vit"), runs["vit"].trainer_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        logits("lm", "packed"), runs["lm"].trainer_logits, rtol=1e-5, atol=1e-5
    )
    probabilities = np.load(tmp_path / "vit-serving_default-probabilities.npy")
    np.testing.assert_allclose(probabilities, tf.nn.softmax(logits("vit")), atol=1e-6)
    # Trained with remat in mixed_bfloat16: float32 in and out, the plain run's graph op for op,
    # no bfloat16 value and nothing of remat in it; near the bfloat16 trainer's logits.
    plain, other = served["vit"]["serving_default"], served["remat_bf16"]["serving_default"]
    assert other["ops"] == plain["ops"]
    for graph in (plain["text"], other["text"], served["lm"]["packed"]["text"]):
        assert "DT_BFLOAT16" not in graph and "remat" not in graph
    np.testing.assert_allclose(logits("remat_bf16"), runs["remat_bf16"].trainer_logits, atol=0.1)
    assert np.abs(logits("remat_bf16") - logits("vit")).max() > 1e-4  # another run's weights


@pytest.mark.slow
def test_export_records_its_source_and_signatures(runs):
    vit = runs["vit"]
    extra = pathlib.Path(vit.export_dir, "assets.extra")
    record = json.loads((extra / "export.json").read_text())
    assert record["step"] == 2 and record["checkpoint"].endswith("checkpoints/ckpt-2")
    assert record["signatures"] == {
        "serving_default": {
            "inputs": {"images": "float32[None,8,8,3]"},
            "outputs": ["logits", "probabilities"],
        }
    }
    assert runs["lm"].record["signatures"]["packed"]["inputs"] == {
        name: "int32[None,None]" for name in ("tokens", "segment_ids", "positions")
    }
    assert "VisionTransformer.dim = 16" in (extra / "config.gin").read_text()


def export_with_flags(model_dir, export_dir, *flags: str):
    """Runs the binary's `main` in this process (flag parsing included); returns export_dir."""
    argv = ["export", f"--model_dir={model_dir}", f"--export_dir={export_dir}", *flags]
    try:
        export.FLAGS(argv)
        assert export.main(["export"]) == 0
    finally:
        export.FLAGS.unparse_flags()
        gin.clear_config()
    return export_dir


@pytest.fixture
def saved_model(tmp_path) -> keras.Model:
    """A model saved as a run the export reads, without a trainer: `tmp_path/run` holds its
    config.gin and checkpoints 1 and 2 (both of its weights)."""
    model_dir = tmp_path / "run"
    model = tiny.model_fn()
    checkpoint = tf.train.Checkpoint(model=model)
    for _ in range(2):
        checkpoint.save(str(model_dir / "checkpoints" / "ckpt"))
    bindings = [f"models.VisionTransformer.{name} = {value}" for name, value in tiny.MODEL.items()]
    config = "\n".join(["Trainer.model_fn = @models.VisionTransformer", *bindings])
    (model_dir / "config.gin").write_text(config + "\n")
    return model


@pytest.mark.tf_compat
def test_exports_a_chosen_checkpoint_into_an_empty_directory(saved_model, tmp_path):
    prefix = f"{tmp_path}/run/checkpoints/ckpt-1"
    assert trained_model.checkpoint_prefix(str(tmp_path / "run"), prefix) == prefix
    (tmp_path / "export").mkdir()
    export_with_flags(tmp_path / "run", tmp_path / "export", "--checkpoint=1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "run"]  # nothing staged
    record = json.loads((tmp_path / "export" / "assets.extra" / "export.json").read_text())
    assert record["checkpoint"] == prefix and record["step"] == 1
    images = tf.random.stateless_uniform([2, 8, 8, 3], seed=[1, 2])
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    np.testing.assert_allclose(served(images=images)["logits"], saved_model(images), atol=1e-5)


def snapshot(directory) -> dict[str, str]:
    """Every file (by its checksum) and directory under `directory`."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        if path.is_file()
        else "directory"
        for path in directory.rglob("*")
    }


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


BAD_INPUT = {
    "missing model_dir": r"nowhere/config.gin not found: is .* the model_dir of a training run",
    "no checkpoint": r"no checkpoint in .*/checkpoints: train first",
    "missing step": r"no checkpoint of step 7 in .*/checkpoints \(steps there: 1, 2\)",
    "missing prefix": r"checkpoint '.*/ckpt-9' not found: give a step of the run or",
    "damaged step": r"cannot restore .*/ckpt-2: .*Checksum does not match.*Choose another",
    "another model": r"cannot be restored \(.*ckpt-2: it lacks weights of the model config.gin",
    "export_dir taken": r"export_dir '.*' already exists and is not an empty directory",
    "export_dir under a file": r"cannot write the export to .*/a_file/export: .*not a directory",
    "config without a model": r"config.gin binds no Trainer.model_fn: it is not the one",
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_error_and_changes_nothing(case, saved_model, tmp_path):
    saved_run = tmp_path / "run"
    model_dir, export_dir, flags = saved_run, tmp_path / "export", []
    if case == "missing model_dir":
        model_dir = tmp_path / "nowhere"
    elif case == "no checkpoint":
        for path in (saved_run / "checkpoints").iterdir():
            path.unlink()
    elif case == "missing step":
        flags = ["--checkpoint=7"]
    elif case == "missing prefix":
        flags = [f"--checkpoint={saved_run}/checkpoints/ckpt-9"]
    elif case == "damaged step":
        flip_a_byte(next((saved_run / "checkpoints").glob("ckpt-2.data-*")))
        flags = ["--checkpoint=2"]
    elif case == "another model":  # a config edited after training: a weight lacks a value
        config = saved_run / "config.gin"
        config.write_text(config.read_text().replace("depth = 2", "depth = 3"))
    elif case == "export_dir under a file":
        (tmp_path / "a_file").write_text("the user's")
        export_dir = tmp_path / "a_file" / "export"
    elif case == "config without a model":
        (saved_run / "config.gin").write_text("")
    else:
        export_dir.mkdir()
        (export_dir / "saved_model.pb").write_text("the user's")
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=BAD_INPUT[case]):
        export_with_flags(model_dir, export_dir, *flags)
    assert snapshot(tmp_path) == before


USER_MODULE = """
import gin


@gin.configurable(module="my_data")
def images(scale=1.0):
    return scale
"""


def test_the_runs_config_imports_only_the_modules_the_user_trusts(
    saved_model, tmp_path, monkeypatch
):
    """A run trained with a module of the user's (`import my_data` in its gin file) exports with
    `--trusted_imports=my_data`; without it the import is refused, not run, and nothing changes."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_data.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    config = tmp_path / "run" / "config.gin"
    lines = ["import my_data", config.read_text(), "Trainer.dataset_fn = @my_data.images"]
    config.write_text("\n".join([*lines, "my_data.images.scale = 2.0", ""]))
    before = snapshot(tmp_path)
    refused = "line 1: 'import my_data': a run's config is read without running its imports"
    with pytest.raises(UserError, match=re.escape(refused) + ".*--trusted_imports=my_data"):
        export_with_flags(tmp_path / "run", tmp_path / "export")
    assert snapshot(tmp_path) == before and "my_data" not in sys.modules
    export_with_flags(tmp_path / "run", tmp_path / "export", "--trusted_imports=my_data")
    assert "my_data" in sys.modules
    images = tf.random.stateless_uniform([2, 8, 8, 3], seed=[3, 4])
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    np.testing.assert_allclose(served(images=images)["logits"], saved_model(images), atol=1e-5)


def test_a_language_model_serves_documents_and_packed_rows(tmp_path):
    """BERT through `export.save` from Python: both signatures, and rows longer than the model."""
    model = language.BertEncoder(**{**TINY_LM, "depth": 1})
    record = export.save(model, str(tmp_path / "bert"), {"model": "bert"})
    assert record["model"] == "bert" and set(record["signatures"]) == {"serving_default", "packed"}
    served = tf.saved_model.load(str(tmp_path / "bert")).signatures
    tokens = tf.constant([[5, 9, 7, 0, 0, 0], [8, 6, 5, 9, 7, 6]])
    segments = tf.constant([[1, 1, 1, 0, 0, 0], [1, 1, 2, 2, 2, 2]])
    positions = tf.constant([[0, 1, 2, 0, 0, 0], [0, 1, 0, 1, 2, 3]])
    rows = {"tokens": tokens, "segment_ids": segments, "positions": positions}
    np.testing.assert_allclose(served["packed"](**rows)["logits"], model(rows), atol=1e-5)
    whole = {
        **rows,
        "segment_ids": tf.ones_like(tokens),
        "positions": tf.constant([[*range(6)]] * 2),
    }
    np.testing.assert_allclose(
        served["serving_default"](tokens=tokens)["logits"], model(whole), atol=1e-5
    )
    too_long = tf.ones([1, TINY_LM["max_length"] + 1], tf.int32)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="longer than max_length=8, the positions"
    ):
        served["serving_default"](tokens=too_long)
    for bad_id in (-1, TINY_LM["vocab_size"]):  # -1 would wrap around to the last row
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"token ids must be in \[0, 32\)"):
            served["serving_default"](tokens=tf.constant([[5, bad_id, 7]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"positions must be in \[0, 8\)"):
        served["packed"](**{**rows, "positions": -positions})
    with pytest.raises(UserError, match=re.escape("cannot export a Sequential")):
        export.serving_functions(keras.Sequential([keras.layers.Dense(2)]))
