"""specmesh: speculative decoding with token trees, lossless verification and gRPC services.

Core (pure tensor code, no model, no I/O): sampling, tree, drafting, verification.
Runtime: models (loading), model_store (offline default pair), runtime (KV caches), engine.
"""

__version__ = "0.1.0"
