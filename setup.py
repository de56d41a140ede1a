from setuptools import find_packages, setup

setup(
    name="megatron_het",
    version="0.1.0",
    description="Megatron-style Llama pretraining on heterogeneous accelerator clusters",
    packages=find_packages(include=["megatron_het", "megatron_het.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "sentencepiece",
        "tensorboard",
        "pyyaml",
        "tqdm",
        "matplotlib",
    ],
    extras_require={"hf": ["transformers", "safetensors"], "test": ["pytest", "pytest-xdist"]},
)
