"""Configuration, secrets handling, AUTH and TLS options, and registration through the
``icefloe`` entry point."""

from __future__ import annotations

import logging
from typing import Any, cast

import pytest
from pydantic import SecretStr, ValidationError

from icefloe.config import PipelineConfig, config_from_dict, redacted_dict
from icefloe.errors import ChannelError, ConfigError
from icefloe.plugins.backends import backend_config, open_backend
from icefloe.plugins.manager import new_plugins
from icefloe_redis import RedisBackend, RedisConfig
from icefloe_redis.config import mask_url

PASSWORD = "s3cret-pa55"


def pipeline(name: str, **coordination: Any) -> PipelineConfig:
    """A pipeline of one topic and one table, with this ``coordination`` section."""
    base = {"name": name, "source": {"topics": ["t"]}, "tables": [{"name": "ns.t"}]}
    return config_from_dict({**base, "coordination": coordination})


def test_defaults_and_client_options():
    c = RedisConfig()
    assert c.url == "redis://127.0.0.1:6379/0"
    assert c.key_prefix == "icefloe"
    assert "password" not in c.client_kwargs()
    tls = RedisConfig(url="rediss://h:6380/0", ssl_ca_certs="/ca.pem", password=SecretStr("x"))
    kwargs = tls.client_kwargs()
    assert kwargs["ssl_ca_certs"] == "/ca.pem"
    assert kwargs["ssl_cert_reqs"] == "required"
    assert kwargs["password"] == "x"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "http://h"}, "URL scheme"),
        ({"url": f"redis://u:{PASSWORD}@h", "password": "x"}, "password is given twice"),
        ({"url": "redis://u@h", "username": "v"}, "username is given twice"),
        ({"url": "redis://h", "ssl_ca_certs": "/ca.pem"}, "rediss://"),
        ({"max_block_s": 10, "socket_timeout_s": 5}, "max_block_s"),
        ({"key_prefix": "a{b}"}, "key_prefix"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_invalid_settings_name_the_key(options, message):
    with pytest.raises(ValidationError, match=message):
        RedisConfig.model_validate(options)


def test_secrets_never_show(caplog):
    url = f"redis://user:{PASSWORD}@127.0.0.1:1/0"
    c = RedisConfig(url=url)
    f = RedisConfig(url="redis://127.0.0.1:1/0", password=SecretStr(PASSWORD))
    for shown in (repr(c), str(c), c.safe_url, repr(f), str(f), str(redacted_dict(f))):
        assert PASSWORD not in shown
    assert c.safe_url == "redis://user:***@127.0.0.1:1/0"
    assert mask_url("rediss://:pw@[::1]:6380/2") == "rediss://:***@[::1]:6380/2"
    assert PASSWORD not in str(redacted_dict(c))
    with caplog.at_level(logging.DEBUG):
        backend = RedisBackend(c.model_copy(update={"socket_connect_timeout_s": 0.5}), "g")
        warnings = backend.doctor()  # nothing listens on port 1
        with pytest.raises(ChannelError) as err:
            backend.writer("w").open()
        backend.close()
    assert warnings
    for text in (*warnings, str(err.value), caplog.text):
        assert PASSWORD not in text


def test_auth_by_url_or_by_fields(private_redis):
    server = private_redis("--requirepass", PASSWORD)
    by_url = RedisConfig(url=f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0")
    by_field = RedisConfig(url=server.url, password=SecretStr(PASSWORD))
    wrong = RedisConfig(url=server.url, password=SecretStr("wrong-" + PASSWORD))
    for cfg in (by_url, by_field):
        backend = RedisBackend(cfg, "g")
        assert backend.writer("w").open() > 0
        backend.close()
    backend = RedisBackend(wrong, "g")
    with pytest.raises(ChannelError) as err:
        backend.writer("w").open()
    backend.close()
    assert PASSWORD not in str(err.value)


def test_registered_through_the_entry_point_and_opened_from_pipeline_config(redis_url):
    plugins = new_plugins(autoload=True)
    spec = plugins.backend("redis")
    assert spec.config_model is RedisConfig
    config = pipeline(
        "entry-point-test",
        backend="redis",
        lease_ttl_s=3.5,
        redis={"url": redis_url, "key_prefix": "icefloe-ep-test"},
    )
    backend = open_backend(config, plugins)
    try:
        assert isinstance(backend, RedisBackend)
        assert backend.group_id == "entry-point-test"
        assert backend.lease_ttl_s == 3.5
        assert backend.keys.events == "icefloe-ep-test:{entry-point-test}:events"
    finally:
        cast(RedisBackend, backend).drop_state()  # narrowed in the try, not here
        backend.close()


def test_bad_backend_section_is_a_config_error_naming_the_key():
    config = pipeline("p", backend="redis", redis={"max_block_s": -1})
    with pytest.raises(ConfigError, match=r"coordination\.redis\.max_block_s"):
        backend_config(config, new_plugins(autoload=True))
