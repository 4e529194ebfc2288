"""`minite up`: the docker-compose topology as plain local processes, for machines without Docker.

Takes the same run settings as `minite train` (RunConfig: `--config run.toml`, MINITE_* env vars,
flags) plus the topology's own. Builds the built-in tiny model if the run uses it and it is not there
yet, writes the resolved run settings to <run_dir>/run.json, starts the rollout service (`--replicas
N`: N rollout processes, the first on the rollout ports, the others on ports the OS picks), the learner
service (pointed at every replica, told to exit after its last step) and, when a `prometheus` binary is
on PATH, a Prometheus that scrapes them all; then runs the RL job through the two services,
prints where the metrics are, and stops everything (or keeps it up with --keep-running). Each
process logs to a file in the run directory; the learner's progress is echoed here.

Whatever ends `minite up` ends its children: SIGTERM / SIGINT / SIGHUP stop them in order (each drains),
and if `minite up` itself is killed (SIGKILL) the kernel sends each child SIGTERM (PR_SET_PDEATHSIG), so
no service is left training or holding its ports. The run directory is locked while `up` runs.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pydantic import Field

from minite_core.rl.config import RunConfig, parse
from minite_core.rl.state import RunDirInUse, lock_run_dir


class UpSettings(RunConfig):
    run_dir: Path = Field(Path("runs/up"), description="logs, the learner's run (learner/), Prometheus data")
    replicas: int = Field(1, ge=1, le=16, description="rollout replicas: the learner spreads prompts over them and "
                                                      "pushes every weight version to all of them")
    host: str = Field("127.0.0.1", description="the address every service listens on")
    rollout_grpc_port: int = Field(50051, ge=1, le=65535, description="the first rollout replica's gRPC port")
    rollout_http_port: int = Field(8000, ge=1, le=65535, description="the first rollout replica's HTTP port (REST, /metrics)")
    learner_grpc_port: int = Field(50052, ge=1, le=65535, description="the learner's gRPC port")
    learner_http_port: int = Field(8001, ge=1, le=65535, description="the learner's HTTP port (REST, /metrics)")
    prometheus: bool = Field(True, description="start Prometheus when the binary is installed")
    prometheus_port: int = Field(9090, ge=1, le=65535, description="the Prometheus server's port (with --prometheus)")
    scrape_interval: str = Field("2s", description="Prometheus scrape interval")
    keep_running: bool = Field(False, description="leave the services and Prometheus up after training (Ctrl-C stops)")
    startup_timeout: float = Field(300.0, gt=0, description="seconds to wait for each service to be ready")


def prometheus_config(s: UpSettings, rollout_http: list[int] | None = None) -> str:
    """The deploy/prometheus/prometheus.yml topology with local addresses (same job names)."""
    targets = ", ".join(f"'{s.host}:{p}'" for p in (rollout_http or [s.rollout_http_port]))
    return (f"global:\n  scrape_interval: {s.scrape_interval}\n  evaluation_interval: {s.scrape_interval}\n"
            "scrape_configs:\n"
            f"  - job_name: minite-rollout\n    static_configs:\n      - targets: [{targets}]\n"
            f"  - job_name: minite-learner\n    static_configs:\n      - targets: ['{s.host}:{s.learner_http_port}']\n")


def _die_with_parent():
    """Ask the kernel for SIGTERM when our parent dies (Linux prctl PR_SET_PDEATHSIG), so a SIGKILLed `minite
    up` leaves no services behind. Resolved here, called in the child between fork and exec."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the signal handlers below still stop the children
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


_PDEATHSIG = _die_with_parent()


class Proc:
    """A child process whose output goes to a log file (and, with echo, to our stdout); `ready` is set
    when a line starts with `ready_prefix`."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict, ready_prefix: str | None = None, echo=False):
        self.name, self.ready, self.lines, self.ready_line = name, threading.Event(), [], ""
        self.log = log.open("w")
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  start_new_session=True, preexec_fn=_PDEATHSIG)
        self.prefix = ready_prefix
        if ready_prefix is None:
            self.ready.set()
        self.echo = echo
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.append(line)
            if self.prefix and line.startswith(self.prefix):
                self.ready_line = line
                self.ready.set()
            if self.echo and (" step " in line or "finished" in line or "wait" in line or "ERROR" in line):
                print(f"[{self.name}] {line.rstrip()}", flush=True)

    def wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        while not self.ready.wait(0.2):
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.p.returncode} before it was ready; "
                                   f"last lines:\n{''.join(self.lines[-15:])}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def _scrape(url: str, *names: str) -> list[float]:
    """Values of Prometheus samples, summed over their label sets (model_name, ...); NaN when the endpoint or
    the sample is missing."""
    import urllib.request

    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return [float("nan")] * len(names)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(None, 1)[1])
    return [values.get(n, float("nan")) for n in names]


def _finished(summary: Path) -> bool:
    """Has the learner written its final summary (the evaluation after the last step)?"""
    try:
        return "after" in json.loads(summary.read_text())
    except (OSError, ValueError):
        return False


def _exit_on(sig, _frame):
    raise SystemExit(128 + sig)  # unwinds into up()'s `finally`, which stops the children


def up(s: UpSettings) -> int:
    token = os.environ.get("MINITE_AUTH_TOKEN")
    if token is not None and not token.strip():
        print("minite up: error: MINITE_AUTH_TOKEN is empty or blank: set a real token, or unset it (then `up` "
              "makes one for its services)", file=sys.stderr)
        return 2
    try:
        lock_run_dir(s.run_dir)  # a second `up` here would delete this one's learner directory
    except RunDirInUse as e:
        print(f"minite up: error: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on)
    # SIGINT raises KeyboardInterrupt even when `up` started with it ignored: a shell starts a background job
    # (`minite up &` in a script) with SIGINT ignored, and Python then installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model_dir = s.model_path
    if not (model_dir / "config.json").exists():
        if not s.builtin_model:
            print(f"minite up: error: {model_dir} has no config.json", file=sys.stderr)
            return 2
        from minite_core.rl.tiny import install_tiny_model

        install_tiny_model(model_dir, seed=s.seed, moe=s.moe, log=lambda *a: print(*a, flush=True))
    if not s.resume:
        shutil.rmtree(s.run_dir / "learner", ignore_errors=True)
    run_file = s.run_dir / "run.json"  # the learner's run: these settings, its own run directory
    run_file.write_text(json.dumps({**s.run_fields(), "model_dir": str(model_dir),
                                    "run_dir": str(s.run_dir / "learner")}, indent=1))
    env = dict(os.environ)
    env.setdefault("MINITE_AUTH_TOKEN", secrets.token_urlsafe(24))  # weight pushes need it; never printed
    py = [sys.executable, "-m", "minite_core.cli"]
    procs: list[Proc] = []
    try:
        replicas = []  # (grpc port, http port) of each rollout replica
        for i in range(s.replicas):
            ports = (s.rollout_grpc_port, s.rollout_http_port) if i == 0 else (0, 0)
            name = "rollout" if s.replicas == 1 else f"rollout-{i}"
            rollout = Proc(name, py + ["rollout", "--model-dir", str(model_dir), "--host", s.host,
                                       "--precision", s.precision, "--backend", s.backend, "--device", s.device,
                                       "--grpc-port", str(ports[0]), "--http-port", str(ports[1])],
                           s.run_dir / f"{name}.log", env, "minite-rollout ready")
            procs.append(rollout)
            rollout.wait_ready(s.startup_timeout)
            bound = dict(kv.split("=", 1) for kv in rollout.ready_line.split() if "=" in kv)
            replicas.append((int(bound["grpc"]), int(bound["http"])))
        prom_bin = shutil.which("prometheus") if s.prometheus else None
        if prom_bin:
            cfg = s.run_dir / "prometheus.yml"
            cfg.write_text(prometheus_config(s, [h for _, h in replicas]))
            procs.append(Proc("prometheus", [prom_bin, f"--config.file={cfg}", f"--storage.tsdb.path={s.run_dir / 'prometheus-data'}",
                                             f"--web.listen-address={s.host}:{s.prometheus_port}"],
                              s.run_dir / "prometheus.log", env))
        learner = Proc("learner", py + ["learner", "--config", str(run_file), "--host", s.host,
                                        *[a for g, _ in replicas for a in ("--rollout", f"{s.host}:{g}")],
                                        "--grpc-port", str(s.learner_grpc_port), "--http-port", str(s.learner_http_port),
                                        *([] if s.keep_running else ["--exit-when-done"])],
                       s.run_dir / "learner.log", env, "minite-learner ready", echo=True)
        procs.append(learner)
        learner.wait_ready(s.startup_timeout)
        for g, h in replicas:
            print(f"rollout:  gRPC {s.host}:{g}, REST http://{s.host}:{h}/v1/completions, "
                  f"metrics http://{s.host}:{h}/metrics", flush=True)
        print(f"learner:  gRPC {s.host}:{s.learner_grpc_port}, REST http://{s.host}:{s.learner_http_port}/v1/status, "
              f"metrics http://{s.host}:{s.learner_http_port}/metrics", flush=True)
        if prom_bin:
            print(f"prometheus: http://{s.host}:{s.prometheus_port} (dashboard queries: deploy/grafana/dashboards/minite.json)",
                  flush=True)
        else:
            print("prometheus: not installed (apt-get install prometheus), metrics are still served on /metrics", flush=True)
        print(f"training {s.steps} GRPO steps through the services; logs in {s.run_dir}/", flush=True)
        summary = s.run_dir / "learner" / "summary.json"
        while learner.p.poll() is None and not (s.keep_running and _finished(summary)):
            time.sleep(0.5)
        code = learner.p.returncode or 0
        if code != 0 or not _finished(summary):
            print(f"the learner exited with code {code}; see {s.run_dir / 'learner.log'}", file=sys.stderr)
            return 1
        sm = json.loads(summary.read_text())
        hist = [json.loads(x) for x in (s.run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
        drift = max((m["sampling/sampling_logp_difference/max"] for m in hist), default=0.0)
        if "eval/reward" in sm["before"]:
            print(f"greedy eval reward: {sm['before']['eval/reward']:.3f} -> {sm['after']['eval/reward']:.3f}", flush=True)
        print(f"max rollout/learner |Δlogp| over {len(hist)} steps: {drift:g}", flush=True)
        for i, (g, h) in enumerate(replicas):
            tokens, version = _scrape(f"http://{s.host}:{h}/metrics", "minite_generation_tokens_total", "minite_weight_version")
            print(f"rollout replica {i} ({s.host}:{g}): {tokens:.0f} tokens sampled, serving weight version {version:.0f}",
                  flush=True)
        print(f"learner metrics: {s.run_dir / 'learner' / 'metrics.jsonl'}, plot: {s.run_dir / 'learner' / 'reward_drift.png'}",
              flush=True)
        if s.keep_running:
            print("services and Prometheus keep running; Ctrl-C stops them", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
        return 0
    except RuntimeError as e:
        print(f"minite up: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("minite up: interrupted: stopping the services", file=sys.stderr, flush=True)
        return 130
    finally:
        for p in reversed(procs):
            p.stop()


def main(argv: list[str]) -> int:
    return up(parse(UpSettings, argv, "minite up"))
