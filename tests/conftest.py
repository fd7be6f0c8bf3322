from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
import torch

from specmesh.core.rounds import Request
from specmesh.core.stats import GenerationResult
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.models import load_model
from tests.servers import gateway_stub, redis_client, save_tiny_models

# Tests run in parallel workers (pytest -n 2 on 2 cores) on tiny tensors: one thread each.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The tiny draft / target pair saved with its tokenizer (tests.servers.save_tiny_models)."""
    return save_tiny_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def reference(models) -> Callable[[Request], GenerationResult]:
    """The in-process SpeculativeEngine on the saved pair: what the services must reproduce."""
    draft = load_model(models["draft"], dtype="fp32", device="cpu")
    target = load_model(models["target"], dtype="fp32", device="cpu")
    return lambda request: SpeculativeEngine(draft, target).generate_many([request])[0]


# For a module whose `stack` fixture has `.gateway` (a tests.servers.Server) and `.redis`.
@pytest.fixture(scope="module")
def stub(stack) -> Iterator:
    """A specmesh.v1.Gateway stub to the module's gateway."""
    with gateway_stub(stack.gateway.address) as stub:
        yield stub


@pytest.fixture(scope="module")
def raw_redis(stack) -> Iterator[redis.Redis]:
    """A plain client of the module's Redis."""
    with redis_client(stack.redis.url) as client:
        yield client
