"""The server under hostile and random traffic: every kind of bad request is a 4xx with an
error body, every valid one a 2xx with a valid body, random requests (hypothesis) never a 5xx,
and the server healthy afterwards. CI runs a sample (``$CONSTRAINED_SPEC_FUZZ_EXAMPLES``, 60 by
default); ``constrained-spec fuzz --examples N`` runs a longer one against any server."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from constrained_spec.bench.hostile import HOSTILE, VALID, check_answer, healthy, request_strategy, send  # noqa: E402
from constrained_spec.serving import ServerConfig, create_app  # noqa: E402
from tests.test_server import _Server  # noqa: E402

pytestmark = pytest.mark.slow
EXAMPLES = int(os.environ.get("CONSTRAINED_SPEC_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def url(smol):
    srv = _Server(create_app(smol, config=ServerConfig(max_batch=4, max_queue=8, request_timeout=60)))
    yield srv.url
    srv.stop()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_every_kind_of_hostile_request_is_a_4xx_with_an_error_body(url, kind):
    answer = send(url, HOSTILE[kind])
    assert 400 <= answer.status < 500, (kind, answer.status, answer.raw[:300])
    assert check_answer(HOSTILE[kind], answer) is None


def test_valid_requests_beside_them_are_valid(url):
    for request in VALID:
        answer = send(url, request)
        assert answer.status == 200 and check_answer(request, answer) is None, answer.raw[:300]
        if answer.body is not None:
            assert answer.body["constrained_spec"]["valid"] is True


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(request=request_strategy())
def test_random_requests_are_never_a_server_error(url, request):
    problem = check_answer(request, send(url, request))
    assert problem is None, (request, problem)


def test_the_server_is_healthy_after_the_fuzzing(url):
    assert healthy(url)
    answer = send(url, VALID[0])
    assert answer.status == 200 and check_answer(VALID[0], answer) is None


def test_a_short_soak_reports_no_problem(url):
    """The soak's own machinery on a few seconds of traffic (the 10-minute run is a command)."""
    from constrained_spec.bench.soak import run_soak

    report = run_soak(minutes=0.2, clients=3, url=url, pid=os.getpid(), warmup_minutes=0.05, seed=1)
    assert report["problems"] == 0 and report["healthy_after"], report["first_problems"]
    assert report["requests"]["valid"] > 0 and report["requests"]["hostile"] > 0
    assert report["valid_answers_valid"] == f"{report['requests']['valid']}/{report['requests']['valid']}"
    assert report["rss_end_mib"] is not None and report["statuses"].get("5xx", 0) == 0
