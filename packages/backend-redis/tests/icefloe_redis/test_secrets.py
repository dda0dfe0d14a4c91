"""No output of a pipeline run on the secured Redis shows its password: show-config, doctor,
status, a standalone coordinator's debug log and metrics, with the password read from a file
(``${file:...}``). The errors of a refused or unreachable server are checked in-process
(test_config.py: ``test_secrets_never_show``, ``test_auth_by_url_or_by_fields``)."""

from __future__ import annotations

from pathlib import Path

from icefloe.testing.cli import assert_run_hides, operator_outputs, pipeline_file
from icefloe_redis import RedisConfig

from .conftest import ACL_PASSWORD
from .conftest import _free_port as free_port


def test_no_output_of_a_run_shows_the_password(tmp_path: Path, secured_redis: RedisConfig) -> None:
    (tmp_path / "redis.pw").write_text(ACL_PASSWORD + "\n")
    settings = {
        "url": secured_redis.url,
        "username": secured_redis.username,
        "password": "${file:redis.pw}",
        "key_prefix": secured_redis.key_prefix,
        "ssl_ca_certs": secured_redis.ssl_ca_certs,
    }
    coordination = {"backend": "redis", "commit_interval_s": 0.5, "redis": settings}
    outputs = operator_outputs(pipeline_file(tmp_path, coordination), free_port())
    assert_run_hides(outputs, ACL_PASSWORD, "redis")
