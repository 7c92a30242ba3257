"""Schemathesis over the gateway's OpenAPI document: no request makes a 5xx.

Every POST route declares its JSON body (app.py `BODIES`), so schemathesis generates schema-valid
and schema-violating bodies for each operation (30 in all, against the ASGI app in-process, with
a fresh session's bearer key (the admin key on the sessions API), the served model's name and a
scripted engine that answers every call) and checks `not_a_server_error`.
`FORGERL_FUZZ_EXAMPLES=500` runs a longer hunt (a debug switch). Schemathesis' own pytest
loader (`from_fixture`) fails under pytest 9, so each operation runs as a plain hypothesis test.
"""

from __future__ import annotations

import os

import pytest

from forgerl.datapool.sqlite import SQLitePool
from forgerl.gateway.app import BODIES, Gateway, create_app
from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import ScriptedEngine, reply

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402


@pytest.fixture
def gateway(tmp_path, tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    engine = ScriptedEngine([reply(renderer, "Fine.")] * 100_000, max_model_len=1 << 16)
    pool = SQLitePool(tmp_path / "pool.sqlite")
    yield Gateway(renderer, engine, pool, model_name="tiny", admin_key="admin")
    pool.close()


@pytest.mark.parametrize("path", list(BODIES))
def test_no_server_errors(gateway, path):
    operation = schemathesis.openapi.from_asgi("/openapi.json", create_app(gateway))[path]["POST"]
    modes = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE

    @given(operation.as_strategy(modes[0]) | operation.as_strategy(modes[1]))
    @settings(max_examples=int(os.environ.get("FORGERL_FUZZ_EXAMPLES", 30)), deadline=None,
              database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        tid, key = gateway.open_session(task_index=-1)
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = "tiny"  # past the 404 model_not_found, into the gateway core
        if case.path_parameters:  # the reward route: a session opened as POST /v1/sessions does
            gateway.external.add(tid)
            case.path_parameters["session_id"] = tid
        admin = path == "/v1/sessions" or path.endswith("/reward")  # the admin key's routes
        case.call_and_validate(headers={"Authorization": f"Bearer {'admin' if admin else key}"},
                               checks=[not_a_server_error])

    fuzz()
