"""The TPU generations' figures that the planner (`framework.memory.tpu`) and the TPU launcher
read from one table."""

from framework.core.tpu_generations import GIB, TPU_GENERATIONS


def test_a_tensorflow_device_is_a_tensorcore_on_v2_and_v3_and_a_chip_after():
    per_device = {name: g.peak_flops_per_device for name, g in TPU_GENERATIONS.items()}
    assert per_device == {
        "v2": 22.5e12,
        "v3": 61.5e12,
        "v4": 275e12,
        "v5e": 197e12,
        "v5p": 459e12,
        "v6e": 918e12,
    }
    assert [name for name, g in TPU_GENERATIONS.items() if g.megacore] == ["v4", "v5p"]


def test_accelerator_types_name_a_generation_by_its_prefix_or_short_name():
    names = {name: g.accelerator_names for name, g in TPU_GENERATIONS.items()}
    assert names["v5e"] == ("v5litepod", "v5e") and names["v4"] == ("v4",)


def test_the_tpu_compiler_plans_for_v4_and_later():
    plannable = [name for name, g in TPU_GENERATIONS.items() if g.compile_only_topology]
    assert plannable == ["v4", "v5e", "v5p", "v6e"]
    assert TPU_GENERATIONS["v5p"].hbm_bytes == 95 * GIB
