"""Shared fixtures (the tiny random model, the real SmolLM2, the development CA, a redis-server), engine
builders and leak checks, and the `slow` mark. Helpers that are not fixtures live in tests/helpers/.

A test is slow when it loads SmolLM2 or starts Ray: it uses a fixture of SLOW_FIXTURES (directly or
through another fixture) or lives in a folder of SLOW_FOLDERS. pytest_collection_modifyitems marks
it, so a new test cannot forget the mark; `make test-fast` (-m "not slow") leaves them out, and a
test that starts Ray without the mark fails.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
import redis

from deploy.config import DEFAULT_WORKER_ENV

# NOTE: before torch loads: this process's own engines (references, fixtures) run beside the
# clusters' workers on the same cores, so they get the workers' environment (OpenMP's wait policy
# is read when torch loads; deploy/config.py says why it matters).
for _name, _value in DEFAULT_WORKER_ENV.items():
    os.environ.setdefault(_name, _value)
# NOTE: Triton's kernels run in its interpreter in tests (tests/engine/test_triton_attention.py), and
# only a process that imports triton under TRITON_INTERPRET=1 can interpret: triton's own library
# functions (tl.zeros, ...) are made interpreted or compiled when triton loads, and torch loads triton
# as it starts where it is installed. So it is set here, before torch, for the whole session.
os.environ["TRITON_INTERPRET"] = "1"

import torch

from deploy.redis_server import RedisServer, generate_password
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.events import KVEvent
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.engine.weights import LoadedModel, default_model_path, load_model
from pdserve.security.certs import DevCerts, make_dev_ca

# NOTE: a shell without job control starts a background command (`make test &`, `nohup ... &`)
# with SIGINT ignored, and every process it starts inherits that. The tests that press Ctrl-C on
# `pdserve up` (SIGINT) would then wait for a stop that never comes. A handler (not SIG_IGN) is
# reset to the default on exec, so the processes the suite starts get SIGINT as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


SLOW_FIXTURES = frozenset({"smollm_loaded", "hf_smollm", "ray_session"})
SLOW_FOLDERS = (Path(__file__).parent / "cluster",)  # every test there runs a cluster of Ray actors


def is_slow(item: pytest.Item) -> bool:
    return (not SLOW_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
            or any(item.path.is_relative_to(folder) for folder in SLOW_FOLDERS))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)


def _ray_is_up() -> bool:
    ray = sys.modules.get("ray")  # never import Ray just to ask
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def _only_slow_tests_start_ray(request):
    ray_was_up = _ray_is_up()
    yield
    if not ray_was_up and _ray_is_up() and request.node.get_closest_marker("slow") is None:
        pytest.fail(f"{request.node.nodeid} started Ray but is not marked slow: use the ray_session fixture "
                    "(tests/cluster/conftest.py), or mark it @pytest.mark.slow", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir), progress=False)


@pytest.fixture(scope="session")
def family_model(tmp_path_factory, tiny_loaded):
    """arch -> (directory, LoadedModel) of write_tiny_model(arch=arch), each written and loaded once
    (the families' tiny twins: pdserve/engine/tiny_model.py TINY_ARCHS)."""
    models: dict[str, tuple[Path, LoadedModel]] = {}

    def get(arch: str) -> tuple[Path, LoadedModel]:
        if arch not in models:
            directory = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch,
                                         tokenizer=tiny_loaded.tokenizer)
            models[arch] = (directory, load_model(str(directory), progress=False))
        return models[arch]

    return get


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory) -> DevCerts:
    """The development CA (`python -m pdserve.security.certs`) every TLS test trusts: a CA, a server
    certificate for 127.0.0.1 and localhost, and a client certificate."""
    return make_dev_ca(tmp_path_factory.mktemp("dev-ca"))


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server per test module, with a password as `pdserve up` starts it (tests that
    break their server make their own)."""
    with RedisServer(password=generate_password()) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def namespace() -> str:
    """A fresh key namespace per test, so tests on one redis-server never share keys."""
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def smollm_loaded() -> LoadedModel:
    return load_model(None, progress=False)


@pytest.fixture(scope="session")
def hf_smollm():
    """transformers' LlamaForCausalLM reading the same GGUF file (the outside oracle)."""
    from transformers import LlamaForCausalLM

    path = default_model_path()
    return LlamaForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


# torch's own kernels, what transformers runs: the oracle tests pin them (tests/engine/test_oracle.py);
# every other test runs the defaults (auto: native where the extension is built).
TORCH_KERNELS = {"linear_kernel": "matmul", "attention_kernel": "sdpa", "pointwise_kernel": "torch"}


def make_engine(loaded: LoadedModel, *, block_size: int = 16, num_blocks: int | None = 256,
                budget: int = 2048, max_seqs: int = 64, kv_dtype: str = "float32",
                prefix_caching: bool = True, linear_kernel: str = "auto", attention_kernel: str = "auto",
                pointwise_kernel: str = "auto",
                host_blocks: int | None = None, disk_dir: str | None = None,
                disk_gib: float = 4.0) -> LLMEngine:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_dtype=kv_dtype,
                        enable_prefix_caching=prefix_caching, host_num_blocks=host_blocks,
                        disk_cache_dir=disk_dir, disk_cache_gib=disk_gib)
    scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return LLMEngine(loaded, EngineConfig(cache=cache, scheduler=scheduler, device="cpu",
                                          linear_kernel=linear_kernel, attention_kernel=attention_kernel,
                                          pointwise_kernel=pointwise_kernel))


class RecordingPublisher:
    """A KVEventPublisher that keeps every event, in order, for tests that check what was published."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.resyncs = 0

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend(events)

    def resync(self) -> None:
        self.resyncs += 1


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every block free or cached-and-unreferenced; every ref count zero; no request left."""
    assert not engine.has_unfinished()
    assert engine.leaked_blocks() == []
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# NOTE: a batch of another shape (other requests beside it, a prefix hit, a chunk) moves float32
# logits by about 1e-6, which flips the greedy choice where the top two logits are closer than
# that: seen on the tiny random model, a gap of 4.8e-7 in one of test_redis_faults' prompts, which
# then decoded other tokens beside 7 other requests than alone. Tests that compare many batched
# requests with a batch-1 reference keep to prompts whose greedy path stays clear of near-ties.
MIN_GREEDY_MARGIN = 1e-4  # a hundred times what batching moves a logit by


def greedy_margin(engine: LLMEngine, prompt: list[int], max_tokens: int) -> float:
    """The smallest gap between the two largest logits along prompt's greedy continuation (a dense
    recompute of the whole sequence at each step, no cache; K/V rounded as the engine's cache stores them)."""
    ids, smallest = list(prompt), float("inf")
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = engine.model.reference_logits(ids, engine.config.cache.kv_dtype)[-1]
            top = torch.topk(logits, 2).values
            smallest = min(smallest, float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return smallest
