"""automap_rl: learning to partition JAX programs across device meshes."""

import setuptools

setuptools.setup(
    name="automap_rl",
    version="0.1.0",
    description="Search and learned policies that find sharding plans for JAX programs.",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["automap_rl*", "envs*", "agents*", "experiments*"]),
    package_data={"automap_rl.workloads": ["*.json"],
                  "agents": ["checkpoints/*/*.json", "checkpoints/*/params/**/*"]},
    install_requires=[
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "dm-haiku==0.0.17",
        "jraph==0.0.6.dev0",
        "mctx==0.0.71",
        "chex",
        "orbax-checkpoint",
        "wandb==0.31.*",
        "pillow",
        "matplotlib",
        "numpy>=2",
        "scipy",
        "tqdm",
        "rich",
        "gymnasium",
        "tyro",
        "highspy",
        "equinox",
    ],
    extras_require={"dev": ["pytest", "pytest-xdist", "hypothesis", "import-linter"]},
    entry_points={"console_scripts": ["automap-rl=experiments.cli:main"]},
)
