"""flexgen_h2o: offloaded batch generation with a fixed-size H2O KV cache."""
from setuptools import find_packages, setup

setup(
    name="flexgen_h2o",
    version="0.1.0",
    description="High-throughput offline generation for OPT and Llama with offloading and H2O eviction",
    packages=find_packages(include=["flexgen_h2o", "flexgen_h2o.*"]),
    python_requires=">=3.10",
    # transformers 5.24 warns that generate's and forward's past_key_values goes in 5.40; the hf cache and its
    # tests pass caches that way, so a clean install must not pick up the release that removes it
    install_requires=["torch", "numpy", "transformers>=5.0,<5.40", "safetensors", "psutil", "tqdm",
                      "ninja"],             # builds the compiled prompt attention (models/fused.py)
    package_data={"flexgen_h2o.models": ["csrc/*.cpp", "csrc/*.h"]},
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "eval": ["rouge-score", "matplotlib"],
        "bench": ["accelerate", "matplotlib"],
        "gguf": ["gguf", "accelerate"],
    },
    entry_points={"console_scripts": ["flexgen-h2o=flexgen_h2o.run:main"]},
)
