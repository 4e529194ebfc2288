"""The services' settings (services/common/settings.py): flags and MINITE_* variables, and CLI errors that say
what is wrong (exit 2, no traceback)."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, words", [
    (["rollout", "--grpc-port", "99999"], "grpc_port"),
    (["rollout", "--precision", "fp8"], "precision must be"),
    (["rollout", "--tls-cert", "/nonexistent.pem"], "tls_cert and tls_key"),
    (["learner", "--rollout", "nohost"], "is not host:port"),
    (["learner", "--steps", "-3"], "steps"),
    (["rollout", "--bogus-flag", "1"], "unrecognized"),
    (["rollout", "--model-dir", "/nonexistent/model"], "has no config.json"),
])
def test_cli_settings_errors(args, words):
    r = subprocess.run([sys.executable, "-m", "minite_core.cli", *args], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "MINITE_GRPC_PORT": "0", "MINITE_HTTP_PORT": "0"})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_env_settings(monkeypatch):
    from services.common.settings import RolloutSettings

    monkeypatch.setenv("MINITE_AUTH_TOKEN", "s3cret")
    monkeypatch.setenv("MINITE_MAX_SLOTS", "3")
    s = RolloutSettings()
    assert s.token == "s3cret" and s.max_slots == 3 and "s3cret" not in repr(s)
