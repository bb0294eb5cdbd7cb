"""The scripts of test_replicas.py and test_many_replicas.py: sharded state over several
replicas trains as the unsharded run does, and its checkpoints restore into other replica counts.

Each process trains the tiny ViT and a tiny decoder LM (dropout on, remat, micro-batches,
gradient clipping) sharded and unsharded on N logical CPUs (one process per N: the runs share
its strategy): every level on 2 replicas, "gradients" and "weights" on 4 (the decoder),
"weights" on 8 (the ViT, without remat and micro-batches: each replica traces and compiles its
own step, a minute per run on 2 cores). Tolerance: the clipping norm is summed in
another order (per part, then over replicas, instead of per weight), so a clipped step can
differ in float32's last bits; after 4 steps every value of the model and the optimizer (about
1 in magnitude) stays within 1e-5 of the unsharded run's. Without clipping the runs are bit
for bit the same (test_training.py). Several workers: test_workers.py.
"""

from tests.subprocesses import run_python

COMMON = """
    import json, os, tempfile
    import numpy as np
    from framework.runtime import Runtime, distribute
    from framework.trainer import Trainer
    from tests import tiny

    MODELS = {{
        "vit": tiny.vit_with_dropout(),
        "decoder": tiny.decoder_with_dropout(tempfile.mkdtemp(), lines=80),
    }}

    FULL_STEP = {{"remat_policy": "nothing_saveable", "microbatches": 2}}

    def trainer(model, model_dir=None, **settings):
        args = {{**tiny.TRAINER_ARGS, **MODELS[model], "global_batch_size": 16,
                 "train_steps": 4, "steps_per_loop": 4, "clip_norm": 0.05, "runtime": RUNTIME,
                 **settings}}
        return Trainer(model_dir, **args)

    def state(t):
        whole = t.sharded.checkpoint_replacements() if t.sharded else {{}}
        variables = t.model.variables + t.optimizer.variables
        return [np.asarray(whole[id(v)].read() if id(v) in whole else v.numpy())
                for v in variables]

    def difference(a, b):
        assert [x.shape for x in a] == [y.shape for y in b]
        return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a, b))
"""

LEVELS_SCRIPT = (
    COMMON
    + """
    distribute.split_cpu({replicas})
    RUNTIME = Runtime("mirrored", cpu_devices={replicas})
    step = FULL_STEP if {full_step!r} else {{}}
    result = {{}}
    for model, levels in {runs!r}.items():
        plain = trainer(model, **step)
        plain.train()
        want = state(plain)
        for level in levels:
            model_dir = os.path.join({out!r}, f"{{model}}-{{level}}")
            sharded = trainer(model, model_dir, shard_state=level, **step)
            assert sharded.strategy.num_replicas_in_sync == {replicas}
            sharded.train()
            if level == "weights":  # one copy on the host, not one per replica's device
                kinds = {{type(v.value).__name__ for v in sharded.model.trainable_variables}}
                assert kinds == {{"ResourceVariable"}}, kinds
            got = state(sharded)
            result[f"{{model}}/{{level}}"] = difference(got, want)
            np.savez(model_dir + ".npz", *got)
    print(json.dumps(result))
"""
)


def levels(replicas: int, runs: dict, out, full_step: bool = True) -> dict:
    script = LEVELS_SCRIPT.format(replicas=replicas, runs=runs, out=str(out), full_step=full_step)
    return run_python(script, timeout=900)
