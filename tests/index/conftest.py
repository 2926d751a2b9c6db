"""A real redis-server per test module, with a password as `pdserve up` starts it, and a fresh
namespace per test so tests never share keys."""

from __future__ import annotations

import uuid

import pytest
import redis

from deploy.redis_server import RedisServer, generate_password


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(password=generate_password()) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:8]}"
