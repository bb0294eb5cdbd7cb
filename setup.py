"""Installs the framework: `pip install -e ".[test]"` is the whole set-up (no Bazel)."""

from setuptools import find_packages, setup

# The TPU compiler, for plans made for a TPU chip on any host (`memory.compiled_bytes(...,
# target="v5e")`, `framework.planner --target=v5e`): libtpu ships it, jax and jaxlib are the only
# way in, and `jax[tpu]==0.10.2` pins this libtpu. framework/core/jax_internals.py names the same
# releases; keep the two in step.
TPU_COMPILER = ["jax==0.10.2", "jaxlib==0.10.2", "libtpu==0.0.42.*"]
# XLA's GPU compiler, for plans made for an NVIDIA GPU on any host (`target="p100"`,
# `--target=a100-40gb`): jax's CUDA plugin (released with jax, the same version) and CUDA 12's
# ptxas, which still assembles for the P100 and V100 (CUDA 13's dropped them). Not `jax[cuda12]`:
# its cuDNN, cuBLAS and NCCL wheels (about 4 GB) run kernels, and nothing runs here.
GPU_COMPILER = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "jax-cuda12-plugin==0.10.2",
    "jax-cuda12-pjrt==0.10.2",
    "nvidia-cuda-nvcc-cu12>=12.6,<13",
]

setup(
    name="framework",
    version="0.1.0",
    description="TensorFlow 2 training with first-class memory: remat policies, planning, XLA.",
    python_requires=">=3.10",
    packages=find_packages(include=["framework", "framework.*"]),
    # The gin configs ship inside the package: an installed framework finds quickstart.gin;
    # so does the sample text corpus of the language-model configs.
    package_data={"framework": ["configs/*.gin", "configs/*/*.gin", "data/text/corpus/*.txt"]},
    install_requires=[
        # TensorFlow 2.20 (the newest TPU build, `tensorflow-tpu`) and 2.21, the releases
        # framework/core/releases.py lists; each tensorflow-text release pins its own
        # TensorFlow minor, so pip pairs them. TF 2.21 no longer pulls TensorBoard.
        "tensorflow>=2.20,<2.22",
        "tensorflow-text>=2.20,<2.22",
        "tensorboard>=2.20",
        "gin-config==0.5.0",
        "absl-py>=2.1",
        "matplotlib>=3.5",  # plan.png of `python -m framework.planner`
    ],
    extras_require={
        # data.tfds; tensorflow-datasets names no TensorFlow version, and 4.9.10 installs and
        # runs beside TensorFlow 2.20 and 2.21 (protobuf, numpy 2).
        "tfds": ["tensorflow-datasets>=4.9.10,<5"],
        "tpu": TPU_COMPILER,
        "gpu": GPU_COMPILER,
        # pytest-xdist: the README's test command runs the suite in 2 worker processes.
        # keras-hub: remat is tested on its backbones (tests/remat/test_user_models.py); 0.32
        # needs keras>=3.15 and tensorflow-text>=2.20.1, which both supported TensorFlows take.
        # The TPU and GPU compilers: their plans are tested on small steps
        # (tests/memory/test_tpu.py, tests/memory/test_gpu.py).
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.6",
            "ruff>=0.6",
            "tensorflow-datasets>=4.9.10,<5",
            "keras-hub>=0.32,<0.33",
            *TPU_COMPILER,
            *GPU_COMPILER,
        ],
    },
    entry_points={
        "console_scripts": [
            "framework-train=framework.train:console_main",
            "framework-plan=framework.planner.__main__:console_main",
            "framework-sample=framework.sample:console_main",
            "framework-export=framework.export:console_main",
        ]
    },
)
