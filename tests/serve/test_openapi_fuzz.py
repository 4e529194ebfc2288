"""Schemathesis over both services' OpenAPI schemas, served for real on loopback (uvicorn).

Each service's schema drives generated requests to every operation: schema-valid ones (positive) and
schema-violating ones (negative). No response may be a 5xx, every status and body must be the documented
one, schema-violating input must be refused with a 4xx, and every 4xx must carry a JSON error message.
"""
import httpx
import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings

from tests.service_helpers import TOKEN, error_message

EXAMPLES = 100  # per fuzzed operation and mode (positive, negative)
# deterministic, no example database written to the working tree, no deadline (CPU model: slow calls), no shrinking
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, print_blob=False,
                phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate], suppress_health_check=list(HealthCheck),
                verbosity=hypothesis.Verbosity.quiet)


@pytest.mark.parametrize("service", ["rollout", "learner"])
def test_openapi_fuzz(service, request):
    schemathesis = pytest.importorskip("schemathesis")  # (Python >= 3.11)
    import requests
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]

    url = request.getfixturevalue(service)[2]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    session = requests.Session()
    sent: dict[str, int] = {}
    failures = []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @FUZZ
            @given(case=op.as_strategy(mode))
            def run(case):
                n = sent[op.label, mode] = sent.get((op.label, mode), 0) + 1
                headers = {"authorization": f"Bearer {TOKEN}"} if op.path in ("/v1/control", "/v1/score") and n % 2 \
                    else None
                response = case.call(session=session, headers=headers, timeout=60)
                case.validate_response(response, checks=checks)  # raises the failures it finds
                if 400 <= response.status_code < 500:
                    assert error_message(response), (response.status_code, response.text)

            try:
                run()
            except hypothesis.errors.Unsatisfiable:  # negative mode of an operation that takes no input
                assert mode is GenerationMode.NEGATIVE, op.label
            except (AssertionError, BaseExceptionGroup) as e:  # (schemathesis: a group of check failures)
                failures.append(f"{op.label} ({mode.value}): {e!r}")
    session.close()
    assert not failures, "\n\n".join(failures)
    ops = {"rollout": ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                       "GET /v1/weight_version", "GET /health"],
           "learner": ["POST /v1/score", "GET /v1/status", "POST /v1/control", "GET /health"]}[service]
    assert set(ops) <= {label for label, _ in sent}, sent
    for o in ops:
        if o.startswith("POST"):  # operations with input: both modes sent a fair number of requests
            assert min(sent[o, GenerationMode.POSITIVE], sent[o, GenerationMode.NEGATIVE]) >= EXAMPLES // 2, sent


def test_openapi_documents_the_errors(rollout, learner):
    """The schemas say what the services answer: 400 (not FastAPI's 422) with the error body."""
    for url, path in [(rollout[2], "/v1/completions"), (rollout[2], "/v1/chat/completions"), (learner[2], "/v1/score")]:
        responses = httpx.get(f"{url}/openapi.json", timeout=30).json()["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "415"} <= set(responses), responses
