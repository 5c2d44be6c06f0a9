"""`foundation/redisconn.py`: a Redis URL's password never shown (redacted, scrubbed from
errors), Sentinel URLs read, a Redis that cannot be reached or that evicts keys refused,
against the session's private redis-server."""

from __future__ import annotations

import re

import pytest
from redis import Redis

from foundation.errors import RedisRefused, RedisUnavailable
from foundation.redisconn import (
    SentinelURL,
    check_policy,
    connect,
    parse_sentinel_url,
    redact,
    scrub,
)
from testing.harness import free_port


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://ann:s3cret@h:6379/0", "redis://ann:***@h:6379/0"),
    ("rediss://:s3cret@h:6380", "rediss://:***@h:6380"),
    ("unix://:s3cret@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
    ("redis+sentinel://:s3cret@a:26379,b:26379/main/1",
     "redis+sentinel://:***@a:26379,b:26379/main/1"),
    ("redis://ann@h:6379", "redis://ann@h:6379"),  # a user, no password
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_a_password_is_never_shown(url: str, shown: str) -> None:
    assert redact(url) == shown
    if "s3cret" in url:
        assert "s3cret" not in scrub(f"Error connecting to {url}: s3cret refused", url)


def test_an_error_naming_the_url_names_it_redacted() -> None:
    url = "redis://:hunter2@10.0.0.1:6379/0"
    text = scrub(f"AUTH failed for {url} (password hunter2)", url)
    assert text == "AUTH failed for redis://:***@10.0.0.1:6379/0 (password ***)"


def test_a_sentinel_url_names_its_sentinels_master_database_and_password() -> None:
    assert parse_sentinel_url("redis+sentinel://:p%40ss@a:26379,10.0.0.2:26380/main/3") == \
        SentinelURL([("a", 26379), ("10.0.0.2", 26380)], "main", 3, "p@ss")
    assert parse_sentinel_url("redis+sentinel://a:26379/main") == \
        SentinelURL([("a", 26379)], "main", 0, None)


@pytest.mark.parametrize(("url", "why"), [
    ("redis+sentinel://:s3cret@a:26379", "expected redis+sentinel://"),
    ("redis+sentinel://:s3cret@a:26379/main/1/2", "expected redis+sentinel://"),
    ("redis+sentinel://:s3cret@a/main", "sentinel 'a' is not HOST:PORT"),
    ("redis+sentinel://:s3cret@a:x/main", "sentinel 'a:x' is not HOST:PORT"),
    ("redis+sentinel://:s3cret@a:1/main/zero", "the database 'zero' is not a number"),
])
def test_a_bad_sentinel_url_is_refused_naming_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)) as bad:
        parse_sentinel_url(url)
    assert "s3cret" not in str(bad.value) and ":***@" in str(bad.value)


def test_a_safe_redis_is_connected_to(redis_url: str) -> None:
    client = connect(redis_url)
    try:
        assert client.ping() is True
    finally:
        client.close()


@pytest.mark.parametrize("scheme", ["redis://:hunter2@127.0.0.1:{port}/0",
                                    "redis+sentinel://:hunter2@127.0.0.1:{port}/main"])
def test_a_redis_out_of_reach_is_unavailable_and_its_password_unsaid(scheme: str) -> None:
    url = scheme.format(port=free_port())
    with pytest.raises(RedisUnavailable, match="cannot reach Redis at") as err:
        connect(url)
    assert "hunter2" not in str(err.value) and redact(url) in str(err.value)
    assert err.value.exit_code == 3


def test_an_evicting_redis_is_refused_unless_unchecked(redis: Redis, redis_url: str) -> None:
    before = redis.config_get("maxmemory-policy")["maxmemory-policy"]
    assert before == "noeviction"
    redis.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(RedisRefused, match="maxmemory-policy=allkeys-lru") as err:
            connect(redis_url)
        assert err.value.exit_code == 4 and "CONFIG SET maxmemory-policy noeviction" in str(
            err.value)
        with pytest.raises(RedisRefused) as named:
            check_policy(redis, "redis://:hunter2@db:6379/0")
        assert "redis://:***@db:6379/0" in str(named.value) and "hunter2" not in str(named.value)
        unchecked = connect(redis_url, check=False)
        assert unchecked.ping() is True
        unchecked.close()
    finally:
        redis.config_set("maxmemory-policy", before)
    check_policy(redis)  # safe again
