"""The ``[coordination.redis]`` section: where the server is, how to authenticate, retention."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

_SCHEMES = ("redis", "rediss", "unix")


def mask_url(url: str) -> str:
    """The URL with any password replaced by ``***``, safe for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


class RedisConfig(BaseModel):
    """Settings of the Redis backend. Secrets are :class:`SecretStr` (or masked in the URL)
    so that printing or logging the model never shows them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        repr=False,  # may carry a password; use `safe_url` in messages
        description="redis://, rediss:// (TLS) or unix:// URL; may carry user:password@",
    )
    username: str | None = Field(default=None, description="ACL user (instead of in the URL)")
    password: SecretStr | None = Field(default=None, description="AUTH password (not in URL)")
    cluster: bool = Field(default=False, description="connect with the Redis Cluster client")
    key_prefix: str = Field(
        default="icefloe",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        description="first part of every key; keys are <prefix>:{<group>}:<name>",
    )
    retain_committed_events: int = Field(
        default=0, ge=0, description="committed events kept in the stream after pruning"
    )
    broadcast_max_len: int = Field(
        default=10_000, gt=0, description="approximate length cap of the broadcast stream"
    )
    max_block_s: float = Field(
        default=2.0, gt=0, description="longest single XREAD BLOCK; longer waits loop"
    )
    socket_timeout_s: float = Field(default=10.0, gt=0)
    socket_connect_timeout_s: float = Field(default=5.0, gt=0)
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    warn_no_persistence: bool = Field(
        default=True, description="log a warning at start-up when Redis has no persistence"
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        scheme = urlsplit(url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(
                f"URL scheme must be one of {', '.join(s + '://' for s in _SCHEMES)}, "
                f"e.g. redis://127.0.0.1:6379/0 (got {scheme or 'none'}://)"
            )
        return url

    @model_validator(mode="after")
    def _check_combinations(self) -> RedisConfig:
        parts = urlsplit(self.url)
        if self.password is not None and parts.password is not None:
            raise ValueError("the password is given twice (url and password); give it once")
        if self.username is not None and parts.username:
            raise ValueError("the username is given twice (url and username); give it once")
        ssl_set = any((self.ssl_ca_certs, self.ssl_certfile, self.ssl_keyfile))
        if (ssl_set or self.ssl_cert_reqs != "required") and parts.scheme != "rediss":
            raise ValueError("ssl_* options need a rediss:// URL (TLS)")
        if self.max_block_s >= self.socket_timeout_s:
            raise ValueError(
                "max_block_s must be below socket_timeout_s, or blocking reads time out"
            )
        return self

    @property
    def safe_url(self) -> str:
        """The URL for messages: password masked."""
        return mask_url(self.url)

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for redis-py's ``from_url`` besides the URL itself."""
        kwargs: dict[str, Any] = {
            "socket_timeout": self.socket_timeout_s,
            "socket_connect_timeout": self.socket_connect_timeout_s,
            "health_check_interval": 30,
        }
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password.get_secret_value()
        if urlsplit(self.url).scheme == "rediss":
            kwargs["ssl_cert_reqs"] = self.ssl_cert_reqs
            for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                value = getattr(self, key)
                if value is not None:
                    kwargs[key] = value
        return kwargs
