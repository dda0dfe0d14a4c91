"""No output of a pipeline run on the secured PostgreSQL shows the role's password: show-config,
doctor, status, a standalone coordinator's debug log and metrics, with the DSN taken from the
environment (``${env:...}``); and a server refusing the password says so without it. (An
unreachable server: ``test_unreachable_server_error_and_logs_hide_the_password`` in
test_config_and_plugin.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
import pytest

from icefloe.errors import ChannelError
from icefloe.testing.cli import assert_run_hides, operator_outputs, pipeline_file
from icefloe_postgres import PostgresBackend
from icefloe_postgres.testing import free_port, make_test_config

from .conftest import APP, APP_PASSWORD, SECURED_SCHEMA, SecuredPostgres


def test_no_output_of_a_run_shows_the_password(tmp_path: Path, secured_pg: SecuredPostgres) -> None:
    postgres = {"dsn": "${env:PIPELINE_DSN}", "schema": SECURED_SCHEMA}
    coordination = {"backend": "postgres", "commit_interval_s": 0.5, "postgres": postgres}
    config = pipeline_file(tmp_path, coordination)
    env = {"PIPELINE_DSN": secured_pg.app_dsn}
    outputs = operator_outputs(config, free_port(), env=env)
    assert "${env:PIPELINE_DSN}" in outputs["show-config"]
    assert_run_hides(outputs, APP_PASSWORD, "postgres")


def test_a_refused_password_is_named_without_it(
    secured_pg: SecuredPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "wrong-pw-Sekrit"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ChannelError) as info:
        PostgresBackend(make_test_config(secured_pg.dsn(APP, wrong), SECURED_SCHEMA), "g")
    assert f'password authentication failed for user "{APP}"' in str(info.value)
    assert wrong not in str(info.value) + caplog.text


def test_a_connection_without_tls_is_refused(secured_pg: SecuredPostgres) -> None:
    with pytest.raises(psycopg.OperationalError, match="no encryption"):
        psycopg.connect(secured_pg.dsn(APP, APP_PASSWORD, sslmode="disable"), connect_timeout=5)
